//! Every probe family, once (see `family`). Their order is the order of the probe table and
//! of the families' metrics in `/metrics`.
use crate::{
    block_io::BlockIoFamily, family::Family, io_worker::IoWorkerFamily, lifecycle::LifecycleFamily,
    query::QueryFamily, query_id::QueryIdFamily, queue_blame::QueueBlameFamily,
    relation::RelationFamily, role_wait::RoleWaitFamily, syscall::SyscallFamily,
    wait_event::WaitEventFamily,
};

pub static FAMILIES: &[&dyn Family] = &[
    &BlockIoFamily,
    &QueueBlameFamily,
    &SyscallFamily,
    &QueryFamily,
    &QueryIdFamily,
    &RelationFamily,
    &IoWorkerFamily,
    &RoleWaitFamily,
    &WaitEventFamily,
    &LifecycleFamily,
];
