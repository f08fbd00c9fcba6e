//! Tensor-parallel sharding on the CPU, the refusals: every split that does not divide
//! (rows, fused members, KV heads, NVFP4 scale blocks, ranks) and every bad collective
//! input is an error naming the values as given (`candle_fp4::error::find` recovers the
//! typed [`ShardError`]), never a panic. The arithmetic of the splits that do divide is in
//! `tests/tensor_parallel.rs`.

use candle_core::{DType, Device, Result, Tensor};
use candle_fp4::error::find;
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{
    all_gather_columns, all_reduce_sum, column_nvfp4, column_parallel, column_parallel_parts,
    column_tensor, fused_column_nvfp4, row_nvfp4, row_parallel, row_parallel_parts, row_tensor,
    FullWeight, HeadSplit, Shard, ShardError,
};

mod quant_linear_common;
use quant_linear_common::{f64s, float_weight, quantized};

const CPU: Device = Device::Cpu;

/// `r` is an error whose message contains every one of `needles`.
fn err_names<T: std::fmt::Debug, E: std::fmt::Display>(
    r: std::result::Result<T, E>,
    needles: &[&str],
) {
    let msg = r.expect_err("an error").to_string();
    for n in needles {
        assert!(msg.contains(n), "`{msg}` does not name `{n}`");
    }
}

#[test]
fn bad_splits_are_errors_naming_the_values() -> Result<()> {
    err_names(Shard::new(0, 0), &["ranks = 0"]);
    err_names(Shard::new(2, 2), &["rank 2", "ranks = 2"]);
    err_names(Shard::new(7, 3), &["rank 7", "ranks = 3"]);
    err_names(Shard::all(0), &["ranks = 0"]);
    let s3 = Shard::new(1, 3)?;
    let s2 = Shard::new(1, 2)?;
    // N not divisible.
    let q = quantized(1, 100, 64);
    err_names(column_nvfp4(&q, s3), &["n = 100", "ranks = 3"]);
    err_names(
        column_tensor(&float_weight(1, 100, 64), s3),
        &["n = 100", "ranks = 3"],
    );
    let full = QuantLinear::from_nvfp4(&q, None, &CPU)?;
    let e = column_parallel(&full, s3, &Device::Cpu).expect_err("100 rows over 3");
    assert!(matches!(
        find::<ShardError>(&e),
        Some(ShardError::NotDivisible {
            size: 100,
            ranks: 3,
            ..
        })
    ));
    // A fused member not divisible, members not summing to N.
    err_names(
        fused_column_nvfp4(&q, &[50, 25, 25], s2),
        &["member 1", "= 25", "ranks = 2"],
    );
    err_names(
        fused_column_nvfp4(&q, &[50, 40], s2),
        &["[50, 40]", "n = 100"],
    );
    err_names(fused_column_nvfp4(&q, &[], s2), &["[]", "n = 100"]);
    err_names(
        fused_column_nvfp4(&q, &[usize::MAX - 1, 2], s2),
        &["n = 100"],
    );
    // KV heads not divisible, heads not in GQA groups.
    let s4 = Shard::new(0, 4)?;
    err_names(
        HeadSplit::new(8, 2, 16, s4),
        &["num_kv_heads", "= 2", "ranks = 4"],
    );
    err_names(
        HeadSplit::new(6, 4, 16, s2),
        &["num_heads = 6", "num_kv_heads = 4"],
    );
    err_names(HeadSplit::new(8, 0, 16, s2), &["num_kv_heads = 0"]);
    err_names(HeadSplit::new(usize::MAX - 1, 2, 2, s2), &["head_dim = 2"]);
    // K/ranks not whole scale blocks: K = 48 over 2 (24 each), K = 64 over 3.
    let q48 = quantized(2, 8, 48);
    err_names(row_nvfp4(&q48, s2), &["k = 48", "ranks = 2", "16-value"]);
    err_names(
        row_nvfp4(&quantized(3, 8, 64), s3),
        &["k = 64", "ranks = 3", "16"],
    );
    let l48 = QuantLinear::from_nvfp4(&q48, None, &CPU)?;
    let e = row_parallel(&l48, s2, &Device::Cpu).expect_err("24 columns");
    assert!(matches!(
        find::<ShardError>(&e),
        Some(ShardError::NotBlockAligned {
            k: 48,
            ranks: 2,
            block: 16
        })
    ));
    err_names(
        row_tensor(&float_weight(1, 8, 50), s3),
        &["k = 50", "ranks = 3"],
    );
    err_names(
        row_tensor(&Tensor::zeros(8, DType::F32, &CPU)?, s2),
        &["[8]"],
    );
    // Malformed NVFP4 buffers, a bias of the wrong shape.
    let mut short = q.clone();
    short.weight.pop();
    err_names(column_nvfp4(&short, s2), &["[100, 64]", "3200", "3199"]);
    err_names(
        row_nvfp4(&Nvfp4Quantized { k: 40, ..q.clone() }, s2),
        &["[100, 40]"],
    );
    let b = Tensor::zeros(99, DType::F32, &CPU)?;
    err_names(
        column_parallel_parts(FullWeight::Nvfp4(&q), Some(&b), s2, &CPU),
        &["[99]", "n = 100"],
    );
    err_names(
        row_parallel_parts(FullWeight::Nvfp4(&q), Some(&b), s2, &CPU),
        &["[99]", "n = 100"],
    );
    let w3 = Tensor::zeros((2, 3, 4), DType::F32, &CPU)?;
    err_names(
        column_parallel_parts(FullWeight::Float(&w3), None, s2, &CPU),
        &["[2, 3, 4]"],
    );
    Ok(())
}

#[test]
fn bad_collective_inputs_are_errors() -> Result<()> {
    let a = Tensor::zeros((2, 3), DType::BF16, &CPU)?;
    let b = Tensor::zeros((2, 4), DType::BF16, &CPU)?;
    err_names(
        all_reduce_sum(&[a.clone(), b.clone()]),
        &["part 1", "[2, 4]", "[2, 3]"],
    );
    err_names(
        all_reduce_sum(&[a.clone(), a.to_dtype(DType::F32)?]),
        &["F32", "BF16"],
    );
    err_names(all_reduce_sum(&[]), &["no parts"]);
    let u = Tensor::zeros((2, 3), DType::U8, &CPU)?;
    err_names(all_reduce_sum(&[u.clone(), u]), &["U8"]);
    let e = all_reduce_sum(&[a.clone(), b.clone()]).expect_err("shapes");
    assert!(matches!(
        find::<ShardError>(&e),
        Some(ShardError::BadInput { .. })
    ));
    // Gather: last dims must be Σ members / ranks, members divisible, leading dims equal.
    err_names(
        all_gather_columns(&[a.clone(), b.clone()], &[6]),
        &["part 1", "[2, 4]"],
    );
    err_names(
        all_gather_columns(&[a.clone(), a.clone()], &[5]),
        &["= 5", "ranks = 2"],
    );
    err_names(all_gather_columns(&[a.clone(), a.clone()], &[]), &["[]"]);
    let c = Tensor::zeros((3, 3), DType::BF16, &CPU)?;
    err_names(
        all_gather_columns(&[a.clone(), c], &[6]),
        &["[3, 3]", "[2, 3]"],
    );
    // And a good gather: member order, then rank order.
    let p0 = Tensor::new(&[[0f32, 1., 10.]], &CPU)?;
    let p1 = Tensor::new(&[[2f32, 3., 11.]], &CPU)?;
    let g = all_gather_columns(&[p0, p1], &[4, 2])?;
    assert_eq!(f64s(&g), [0., 1., 2., 3., 10., 11.]);
    Ok(())
}
