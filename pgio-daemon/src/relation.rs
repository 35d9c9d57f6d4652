//! The relation family (issue 31, in progress): IO per PostgreSQL relation. So far its
//! userspace name source, `names`: which table or index a relation file is, from the
//! cluster's catalog files. The kernel side (the file of each tracked read, write and fsync)
//! and the metric families come next.
pub mod names;
