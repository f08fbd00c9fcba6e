//! The kernel images build.rs compiled, and which one a device loads.

use crate::gemv::KernelImage;
use candle_core::{bail, Result};

/// One compiled form of a kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Image {
    Sm90aCubin,
    Sm100aCubin,
    Sm80Cubin,
    Compute90Ptx,
    Compute80Ptx,
}

macro_rules! images_of {
    ($stem:literal) => {
        [
            include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, "_sm90a.cubin")).as_slice(),
            include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, "_sm100a.cubin")).as_slice(),
            include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, "_sm80.cubin")).as_slice(),
            include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, "_compute90.ptx")).as_slice(),
            include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, "_compute80.ptx")).as_slice(),
        ]
    };
}

/// Kernel source files (stems of `kernels/*.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum KernelFile {
    Gemv,
    Ultraquant,
}

impl KernelFile {
    pub(crate) fn name(self) -> &'static str {
        match self {
            KernelFile::Gemv => "gemv",
            KernelFile::Ultraquant => "ultraquant",
        }
    }

    fn all_images(self) -> [&'static [u8]; 5] {
        match self {
            KernelFile::Gemv => images_of!("gemv"),
            KernelFile::Ultraquant => images_of!("ultraquant"),
        }
    }
}

impl Image {
    /// The bytes of `file` in this image.
    pub(crate) fn bytes(self, file: KernelFile) -> &'static [u8] {
        let all = file.all_images();
        match self {
            Image::Sm90aCubin => all[0],
            Image::Sm100aCubin => all[1],
            Image::Sm80Cubin => all[2],
            Image::Compute90Ptx => all[3],
            Image::Compute80Ptx => all[4],
        }
    }

    pub(crate) fn is_ptx(self) -> bool {
        matches!(self, Image::Compute90Ptx | Image::Compute80Ptx)
    }

    /// Whether the image has clusters and PDL (sm_90+ code).
    pub(crate) fn has_sm90_features(self) -> bool {
        !matches!(self, Image::Sm80Cubin | Image::Compute80Ptx)
    }

    /// The image for a device of compute capability `(major, minor)`.
    pub(crate) fn select(cc: (i32, i32), want: KernelImage) -> Result<Image> {
        if cc.0 < 8 {
            bail!(
                "candle-fp4: compute capability {}.{} is too old (the kernels need sm_80 or newer)",
                cc.0,
                cc.1
            );
        }
        Ok(match (want, cc) {
            (KernelImage::Sm80, _) => Image::Compute80Ptx,
            (KernelImage::Auto, (9, 0)) => Image::Sm90aCubin,
            (KernelImage::Auto, (10, 0)) => Image::Sm100aCubin,
            (KernelImage::Auto, (8, _)) => Image::Sm80Cubin,
            (KernelImage::Auto, _) => Image::Compute90Ptx,
        })
    }
}
