//! The capture hook: what a forward pass reports about the inputs of a block's Linears
//! (the quantizer's calibration collects them; inference passes a hook that does nothing).

use candle_core::{Result, Tensor};

/// The Linears of a decoder block that see the same input, in the order the block runs
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// q/k/v_proj: the attention norm's output.
    Qkv,
    /// o_proj: the attention heads' output.
    O,
    /// gate/up_proj: the MLP norm's output.
    GateUp,
    /// down_proj: `silu(gate)·up`.
    Down,
}

impl Site {
    /// All four sites, in the order the block runs them.
    pub const ALL: [Site; 4] = [Site::Qkv, Site::O, Site::GateUp, Site::Down];

    /// The site's index in [`Site::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A callback that a forward pass calls with the input of each Linear group (`[t, in]` in
/// the activation dtype, exactly the tensor the projection is given) before running it.
pub type LinearInputs<'a> = dyn FnMut(Site, &Tensor) -> Result<()> + 'a;

/// A [`LinearInputs`] hook that ignores what it is given (the inference forward).
pub fn ignore_inputs(_: Site, _: &Tensor) -> Result<()> {
    Ok(())
}
