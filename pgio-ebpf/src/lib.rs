#![no_std]
//! Empty library so `pgio-daemon` can name this crate as a build-dependency (aya-build
//! builds the `pgio` binary for the BPF target).
