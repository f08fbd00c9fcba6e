//! Typed errors of the model layer, for callers that branch on the kind of failure (the
//! library's [`candle_fp4::error::CheckpointError`] covers files and tensors), and
//! [`find`], which digs one out of an `anyhow::Error`.
//!
//! Every message names the file, tensor or field and shows the offending value as read.

/// A `config.json` (or a GGUF's metadata turned into one), or a load option checked
/// against it, that this port cannot run correctly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required field is absent.
    #[error("{origin}: missing `{field}`")]
    MissingField {
        /// The config.
        origin: String,
        /// The field.
        field: String,
    },
    /// A field has the wrong type or a value out of range.
    #[error("{origin}: `{field}` must be {expected}, got {value}")]
    BadField {
        /// The config.
        origin: String,
        /// The field.
        field: String,
        /// The value as written in the file.
        value: String,
        /// What is accepted.
        expected: String,
    },
    /// A feature this port does not implement (architecture, activation, RoPE type).
    #[error("{origin}: {field} `{value}` is not supported ({supported})")]
    Unsupported {
        /// The config.
        origin: String,
        /// The field.
        field: String,
        /// The value as written.
        value: String,
        /// What this port runs.
        supported: String,
    },
    /// A size computed from config fields overflows; the factors as read.
    #[error("{origin}: {expr} overflows")]
    Overflow {
        /// The config.
        origin: String,
        /// The computation with its factors, e.g. `num_attention_heads 288230376151711747 × head_dim 64`.
        expr: String,
    },
    /// `num_hidden_layers` differs from the decoder layers the weights hold.
    #[error("{origin}: num_hidden_layers is {config} but {weights} holds {found} decoder layers")]
    LayerCountMismatch {
        /// The config.
        origin: String,
        /// `num_hidden_layers` as read.
        config: u64,
        /// The checkpoint.
        weights: String,
        /// Layers found (one more than the largest `model.layers.N` index).
        found: u64,
    },
    /// A weight's shape is not what the config says.
    #[error("{origin}: `{tensor}` is {found:?}, the config needs {expected:?}")]
    ShapeMismatch {
        /// The checkpoint.
        origin: String,
        /// The tensor or fused layer.
        tensor: String,
        /// Its `[out, in]` shape.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// The context asked for (`max_seq_len`, `--max-seq-len`, `--ctx`) is beyond the
    /// model's `max_position_embeddings` and the override was not given.
    #[error("a context of {requested} tokens exceeds the model's max_position_embeddings {max_position_embeddings} ({origin}); allow it explicitly (LoadOptions::allow_long_context, --allow-long-context) to run positions the model was not trained for")]
    ContextTooLong {
        /// The config.
        origin: String,
        /// The context asked for.
        requested: u64,
        /// The model's limit.
        max_position_embeddings: u64,
    },
    /// A load option or flag out of range.
    #[error("{option} = {value}: {expected}")]
    BadOption {
        /// The option or flag.
        option: String,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: String,
    },
}

/// A GGUF file whose header or metadata cannot be a Llama this port runs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The byte layout is broken (truncated, a length beyond the file, a bad type).
    #[error("{path}: not a readable GGUF file: {reason}")]
    Header {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A metadata value out of range or of the wrong type.
    #[error("{path}: GGUF metadata `{key}` = {value}: {expected}")]
    BadMetadata {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// The value as read.
        value: String,
        /// What is accepted.
        expected: String,
    },
    /// A required metadata key is absent.
    #[error("{path}: GGUF metadata `{key}` is missing")]
    MissingMetadata {
        /// The file.
        path: String,
        /// The key.
        key: String,
    },
    /// `llama.block_count` differs from the `blk.N` tensors present.
    #[error(
        "{path}: llama.block_count is {block_count} but the file holds tensors of {found} blocks"
    )]
    LayerCountMismatch {
        /// The file.
        path: String,
        /// The metadata value.
        block_count: u64,
        /// One more than the largest `blk.N` index.
        found: u64,
    },
    /// A tensor entry that cannot be read (size overflow, data beyond the file, a shape
    /// its type cannot hold).
    #[error("{path}: tensor `{tensor}`: {reason}")]
    BadTensor {
        /// The file.
        path: String,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
}

/// Non-finite numbers where the result would otherwise be silently wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum NumericError {
    /// Logits hold NaN or ±∞.
    #[error("the logits at {at} hold {value} (first at vocabulary id {id}): the model produced non-finite numbers")]
    NonFiniteLogits {
        /// Where, e.g. `window 2, token 17` or `generation step 3 (position 40)`.
        at: String,
        /// The first bad value.
        value: f32,
        /// Its vocabulary id.
        id: usize,
    },
}

/// The first `E` anywhere in `err` (its context chain, and what candle and `std::io`
/// box); see [`candle_fp4::error::find`].
pub fn find<E: std::error::Error + 'static>(err: &anyhow::Error) -> Option<&E> {
    err.chain().find_map(candle_fp4::error::find::<E>)
}

/// An error when `values` (logits of `[vocab]`) hold a non-finite number.
pub fn check_finite_logits(
    values: &[f32],
    at: impl FnOnce() -> String,
) -> Result<(), NumericError> {
    match values.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(id) => Err(NumericError::NonFiniteLogits {
            at: at(),
            value: values[id],
            id,
        }),
    }
}
