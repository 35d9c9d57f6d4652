//! Struct field offsets the eBPF programs need, from the running kernel's BTF, written into
//! their `KERNEL_OFFSETS` global at load. Rust eBPF has no CO-RE field relocations yet, so this
//! is the loader doing the relocation by hand.
use anyhow::Result;
use pgio_common::kernel_offsets::KernelOffsets;

use crate::btf::KernelBtf;

/// The programs' global the offsets go into.
pub const GLOBAL: &str = "KERNEL_OFFSETS";

pub fn from_btf(btf: &KernelBtf) -> Result<KernelOffsets> {
    // The request's disk: `rq->q->disk` since 5.15, `rq->rq_disk` until 5.19 (6.0 removed it).
    let (queue_disk, request_disk) = match btf.offset_of("request_queue", "disk") {
        Ok(off) => (off, 0),
        Err(queue_err) => {
            let off = btf.offset_of("request", "rq_disk").map_err(|e| {
                anyhow::anyhow!("no way from a request to its disk: {queue_err:#}; {e:#}")
            })?;
            (0, off)
        }
    };
    // A bio's disk: `bio->bi_bdev->bd_disk` since 5.12, `bio->bi_disk` before.
    let (bio_bdev, bio_disk) = match btf.offset_of("bio", "bi_bdev") {
        Ok(off) => (off, 0),
        Err(bdev_err) => {
            let off = btf.offset_of("bio", "bi_disk").map_err(|e| {
                anyhow::anyhow!("no way from a bio to its disk: {bdev_err:#}; {e:#}")
            })?;
            (0, off)
        }
    };
    // The task's state: `__state` since 5.14, `state` before.
    let task_state = btf
        .offset_of("task_struct", "__state")
        .or_else(|_| btf.offset_of("task_struct", "state"))?;
    // Run-queue time: only with `CONFIG_SCHED_INFO` (0: `query_wait` is off).
    let task_run_delay = match (
        btf.offset_of("task_struct", "sched_info"),
        btf.offset_of("sched_info", "run_delay"),
    ) {
        (Ok(a), Ok(b)) => a + b,
        _ => 0,
    };
    Ok(KernelOffsets {
        request_cmd_flags: btf.offset_of("request", "cmd_flags")?,
        request_data_len: btf.offset_of("request", "__data_len")?,
        request_q: btf.offset_of("request", "q")?,
        queue_disk,
        request_disk,
        block_rq_arg: first_arg_is_queue(btf, "block_rq_insert")?,
        gendisk_major: btf.offset_of("gendisk", "major")?,
        gendisk_first_minor: btf.offset_of("gendisk", "first_minor")?,
        task_pid: btf.offset_of("task_struct", "pid")?,
        task_tgid: btf.offset_of("task_struct", "tgid")?,
        task_mm: btf.offset_of("task_struct", "mm")?,
        mm_arg_start: btf.offset_of("mm_struct", "arg_start")?,
        bio_bdev,
        bio_disk,
        bdev_disk: btf.offset_of("block_device", "bd_disk")?,
        gendisk_queue: btf.offset_of("gendisk", "queue")?,
        queue_mq_ops: btf.offset_of("request_queue", "mq_ops")?,
        bio_opf: btf.offset_of("bio", "bi_opf")?,
        bio_size: btf.offset_of("bio", "bi_iter")? + btf.offset_of("bvec_iter", "bi_size")?,
        block_bio_arg: first_arg_is_queue(btf, "block_bio_queue")?,
        syscall_args_from_regs: u32::from(
            cfg!(target_arch = "x86_64") && btf.has_helper("BPF_FUNC_task_pt_regs"),
        ),
        task_state,
        task_run_delay,
    })
}

/// The index of the `struct request *` (or `struct bio *`) among a block tracepoint's
/// arguments: Linux 5.11 dropped the leading `struct request_queue *` of `block_rq_insert`
/// (issue and requeue changed with it) and of `block_bio_queue`. A kernel without the hook
/// gets 0 (the program will not attach anyway).
fn first_arg_is_queue(btf: &KernelBtf, tracepoint: &str) -> Result<u32> {
    Ok(match btf.btf_tracepoint_args(tracepoint)? {
        Some(2) => 1,
        Some(1) | None => 0,
        Some(n) => anyhow::bail!("{tracepoint} has {n} arguments: expected 1 or 2"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this machine's BTF: the fields must exist and land where 6.x kernels put them.
    #[test]
    fn offsets_from_running_kernel() {
        if !std::path::Path::new(crate::btf::VMLINUX).exists() {
            eprintln!("skipped: no {}", crate::btf::VMLINUX);
            return;
        }
        let o = from_btf(&KernelBtf::open().expect("BTF")).expect("offsets");
        assert!(o.request_q < o.request_cmd_flags + 64, "{o:?}");
        assert!(
            o.task_tgid == o.task_pid + 4,
            "pid and tgid are adjacent: {o:?}"
        );
        assert!(o.gendisk_first_minor == o.gendisk_major + 4, "{o:?}");
        // This kernel (6.x): the disk through the queue, the request first.
        assert!(o.queue_disk > 0 && o.request_disk == 0, "{o:?}");
        assert_eq!(o.block_rq_arg, 0, "{o:?}");
        assert_eq!(o.block_bio_arg, 0, "{o:?}");
        assert!(o.bio_bdev > 0 && o.bio_disk == 0, "{o:?}");
    }
}
