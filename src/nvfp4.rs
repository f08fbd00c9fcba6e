//! NVFP4
