//! ggml's activation quantization and scalar dot products against ggml's own C: the fixtures of
//! `tests/fixtures/gguf/dot/` were written by `oracle.c` there, linked against llama.cpp's
//! `ggml-quants.c` and `ggml-cpu/quants.c` (commit and compiler in `make_fixtures.sh`).

use picchio_core::format::gguf::GgmlType;
use picchio_runtime::kernels::ggml::q8::{activation_bytes, quantize_q8_0, quantize_q8_1, quantize_q8_k, Q8Arith};
use picchio_runtime::kernels::ggml::{ggml_matvec, ggml_matvec_at, vec_dot, vec_dot_type, DOT_TYPES};
use picchio_runtime::kernels::Level;
use picchio_tests::fixture;

/// Activation rows in `act.f32` and values per row.
const N_VEC: usize = 4;
const N_ELEMS: usize = 1024;

fn dot_fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixture("gguf").join("dot").join(name)).unwrap()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// The activation rows the oracle quantized.
fn activations() -> Vec<Vec<f32>> {
    let x = f32s(&dot_fixture("act.f32"));
    assert_eq!(x.len(), N_VEC * N_ELEMS);
    x.chunks_exact(N_ELEMS).map(<[f32]>::to_vec).collect()
}

type Quantize = fn(&[f32], &mut [u8]) -> Result<(), picchio_runtime::kernels::ggml::DotError>;

/// Every activation row quantized to Q8_0 and Q8_1 (both of ggml's arithmetics) and to Q8_K has
/// exactly the bytes ggml wrote, block by block; the two arithmetics differ on these rows (the
/// rows have exact ties), so both are pinned.
#[test]
fn activation_quantization_equals_ggml_byte_for_byte() {
    let x = activations();
    let cases: [(&str, GgmlType, usize, Quantize); 5] = [
        ("q8_0_ref.bin", GgmlType::Q8_0, 34, |x, o| quantize_q8_0(Q8Arith::Reference, x, o)),
        ("q8_0_x86.bin", GgmlType::Q8_0, 34, |x, o| quantize_q8_0(Q8Arith::X86Avx, x, o)),
        ("q8_1_ref.bin", GgmlType::Q8_1, 36, |x, o| quantize_q8_1(Q8Arith::Reference, x, o)),
        ("q8_1_x86.bin", GgmlType::Q8_1, 36, |x, o| quantize_q8_1(Q8Arith::X86Avx, x, o)),
        ("q8_k.bin", GgmlType::Q8_K, 292, quantize_q8_k),
    ];
    for (file, ty, block, quantize) in cases {
        let want = dot_fixture(file);
        let row_bytes = activation_bytes(ty, N_ELEMS).unwrap();
        assert_eq!(want.len(), N_VEC * row_bytes, "{file}");
        for (v, x) in x.iter().enumerate() {
            let mut got = vec![0u8; row_bytes];
            quantize(x, &mut got).unwrap();
            let want = &want[v * row_bytes..(v + 1) * row_bytes];
            let bad: Vec<usize> = (0..row_bytes / block)
                .filter(|&b| got[b * block..(b + 1) * block] != want[b * block..(b + 1) * block])
                .collect();
            assert!(
                bad.is_empty(),
                "{file}, row {v}: blocks {bad:?} differ from ggml's; first: ours {:?}, ggml {:?}",
                &got[bad[0] * block..(bad[0] + 1) * block],
                &want[bad[0] * block..(bad[0] + 1) * block]
            );
        }
    }
    for (r, a) in [("q8_0_ref.bin", "q8_0_x86.bin"), ("q8_1_ref.bin", "q8_1_x86.bin")] {
        assert_ne!(dot_fixture(r), dot_fixture(a), "the fixture tells the two arithmetics apart");
    }
}

/// Every weight type's dot product with its activation type has the f32 bits of ggml's generic C:
/// per activation row, the type's 1024 fixture weights (`dequant/<TYPE>.bin`) as one row
/// (many blocks: the cross-block accumulation order), then as 4 rows of 256 via [`ggml_matvec`];
/// and the same through [`ggml_matvec_at`] at every kernel level this CPU has.
#[test]
fn dot_products_equal_ggml_generic_c_bit_for_bit() {
    let want = f32s(&dot_fixture("dot.f32"));
    assert_eq!(want.len(), DOT_TYPES.len() * N_VEC * 5);
    let act = |ty: GgmlType| match ty {
        GgmlType::Q8_0 => dot_fixture("q8_0_ref.bin"),
        GgmlType::Q8_1 => dot_fixture("q8_1_ref.bin"),
        _ => dot_fixture("q8_k.bin"),
    };
    let mut want = want.chunks_exact(5);
    let mut checked = 0;
    for ty in DOT_TYPES {
        let w = std::fs::read(fixture("gguf").join("dequant").join(format!("{}.bin", ty.name()))).unwrap();
        assert_eq!(w.len(), ty.bytes_for(N_ELEMS as u64).unwrap() as usize, "{ty}: 1024 weights");
        let act_ty = vec_dot_type(ty).unwrap();
        let (act_all, row_bytes) = (act(act_ty), activation_bytes(act_ty, N_ELEMS).unwrap());
        for v in 0..N_VEC {
            let want = want.next().unwrap();
            let a = &act_all[v * row_bytes..(v + 1) * row_bytes];
            let mut got = [vec_dot(ty, &w, a).unwrap(), 0.0, 0.0, 0.0, 0.0];
            ggml_matvec(ty, &w, &a[..activation_bytes(act_ty, 256).unwrap()], &mut got[1..]).unwrap();
            let (g, wb): (Vec<u32>, Vec<u32>) =
                (got.iter().map(|f| f.to_bits()).collect(), want.iter().map(|f| f.to_bits()).collect());
            assert_eq!(g, wb, "{ty}, activation row {v}: ours {got:?}, ggml {want:?}");
            assert!(want.iter().any(|f| *f != 0.0), "{ty}, row {v}: the fixture is not all zeros");
            // The SIMD kernels give the same bits (a level the CPU lacks is skipped).
            for level in Level::ALL {
                if !level.is_supported() {
                    println!("{level}: not supported by this CPU, skipped");
                    continue;
                }
                let mut simd = [0f32; 5];
                ggml_matvec_at(level, ty, &w, a, &mut simd[..1]).unwrap();
                ggml_matvec_at(level, ty, &w, &a[..activation_bytes(act_ty, 256).unwrap()], &mut simd[1..]).unwrap();
                let s: Vec<u32> = simd.iter().map(|f| f.to_bits()).collect();
                assert_eq!(s, wb, "{ty} at {level}, activation row {v}: {simd:?}, ggml {want:?}");
            }
            checked += 5;
        }
    }
    assert!(want.next().is_none());
    println!("{checked} dot products bit-identical to ggml's generic C");
}
