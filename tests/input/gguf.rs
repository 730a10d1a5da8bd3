//! The GGUF reader: hand-computed dequantization blocks, every metadata type, and corrupt files
//! (synthetic and the real model truncated or with flipped header bytes) giving typed errors.

use crate::common;

use half::f16;
use webgpu_llm::gguf::{Array, GgmlType, Gguf, GgufError, GgufWriter, TensorInfo, Value, ValueRef};
use webgpu_llm::quant::dequantize;

fn info(ty: GgmlType, n: u64) -> TensorInfo {
    TensorInfo { name: "t".into(), shape: vec![n], ty, file_offset: 0, byte_size: ty.byte_size(n).unwrap() }
}

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

#[test]
fn dequantizes_f32_and_f16_values() {
    let bytes: Vec<u8> = [1.5f32, -2.25, 0.0, 1e-7].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequantize(&info(GgmlType::F32, 4), &bytes).unwrap(), [1.5, -2.25, 0.0, 1e-7]);
    // 0x3C00 = 1.0, 0xC000 = -2.0, 0x3800 = 0.5, 0x7BFF = 65504 (largest f16), 0x0001 = 2^-24.
    let bytes = [0x00, 0x3C, 0x00, 0xC0, 0x00, 0x38, 0xFF, 0x7B, 0x01, 0x00];
    assert_eq!(dequantize(&info(GgmlType::F16, 5), &bytes).unwrap(), [1.0, -2.0, 0.5, 65504.0, 2f32.powi(-24)]);
    // BF16 0x3FC0 = 1.5, 0xC020 = -2.5.
    assert_eq!(dequantize(&info(GgmlType::BF16, 2), &[0xC0, 0x3F, 0x20, 0xC0]).unwrap(), [1.5, -2.5]);
}

#[test]
fn dequantizes_a_hand_made_q4_0_block() {
    // d = 0.5; byte j holds q = j in its low nibble (element j) and 15 - j in its high nibble (element j + 16).
    let mut block = h(0.5).to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let got = dequantize(&info(GgmlType::Q4_0, 32), &block).unwrap();
    // value = (q - 8) * d
    assert_eq!(&got[..4], &[-4.0, -3.5, -3.0, -2.5]);
    assert_eq!(got[15], 3.5);
    assert_eq!(&got[16..18], &[3.5, 3.0]);
    assert_eq!(got[31], -4.0);
}

#[test]
fn dequantizes_a_hand_made_q4_1_block() {
    // d = 0.25, m = -1; low nibbles q = j, high nibbles q = 3.
    let mut block = h(0.25).to_vec();
    block.extend(h(-1.0));
    block.extend((0..16u8).map(|j| j | (3 << 4)));
    let got = dequantize(&info(GgmlType::Q4_1, 32), &block).unwrap();
    // value = q * d + m
    assert_eq!(&got[..5], &[-1.0, -0.75, -0.5, -0.25, 0.0]);
    assert_eq!(got[15], 2.75);
    assert!(got[16..].iter().all(|&v| v == -0.25));
}

#[test]
fn dequantizes_a_hand_made_q8_0_block_and_several_blocks() {
    // Two blocks: d = 2 with q = j - 16; d = -0.125 with q = 127, -128, 0, ...
    let mut data = h(2.0).to_vec();
    data.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
    data.extend(h(-0.125));
    data.extend([127u8, 128, 0].iter().chain([0u8; 29].iter()));
    let got = dequantize(&info(GgmlType::Q8_0, 64), &data).unwrap();
    assert_eq!(&got[..3], &[-32.0, -30.0, -28.0]);
    assert_eq!(got[31], 30.0);
    assert_eq!(&got[32..35], &[-15.875, 16.0, 0.0]);
}

#[test]
fn unsupported_types_are_named() {
    let i = info(GgmlType::IQ2XXS, 256);
    let err = dequantize(&i, &[0; 66]).unwrap_err();
    assert!(err.to_string().contains("IQ2_XXS"), "{err}");
}

fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-5)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("f32", Value::F32(0.125)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("héllo ✓".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(-1e300)),
        ("array.strings", Value::List(Array::from(vec!["a", ""]))),
        ("array.i32", Value::List(Array::I32(vec![1, -1]))),
        ("array.nested", Value::List(Array::Array(vec![Array::F32(vec![1.0]), Array::F32(vec![2.0])]))),
        ("array.empty", Value::List(Array::U8(vec![]))),
    ]
}

fn small_file(version: u32) -> Vec<u8> {
    let mut w = GgufWriter::new(version);
    for (k, v) in every_value_type() {
        w.metadata(k, v);
    }
    let q8: Vec<u8> = h(1.0).iter().copied().chain(0..32u8).collect();
    w.tensor("a.weight", &[32], GgmlType::Q8_0, q8);
    w.tensor("b.weight", &[2, 3], GgmlType::F32, (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect());
    w.to_bytes()
}

#[test]
fn reads_every_metadata_type_in_versions_2_and_3() {
    for version in [2, 3] {
        let bytes = small_file(version);
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.version, version);
        for (k, v) in every_value_type() {
            assert_eq!(g.get(k), Some(&v), "key {k}");
        }
        let b = g.tensor("b.weight").unwrap();
        assert_eq!(b.shape, [2, 3]);
        assert_eq!(b.rows(), (2, 3));
        assert_eq!(dequantize(b, b.data(&bytes)).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(b.file_offset % 32, 0);
        assert_eq!(g.get_u64("u8").unwrap(), Some(200));
        assert!(matches!(g.get_u64("string"), Err(GgufError::WrongValueType { .. })));
    }
}

#[test]
fn honours_general_alignment() {
    let mut w = GgufWriter::new(3);
    w.metadata("general.alignment", Value::U32(64));
    w.tensor("x", &[3], GgmlType::F32, vec![0; 12]).tensor("y", &[1], GgmlType::F32, 7f32.to_le_bytes().to_vec());
    let bytes = w.to_bytes();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    let y = g.tensor("y").unwrap();
    assert_eq!(y.file_offset - g.data_offset, 64);
    assert_eq!(dequantize(y, y.data(&bytes)).unwrap(), [7.0]);
}

/// Offset of the field after the named tensor's name in its tensor info.
fn tensor_info_at(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    bytes.windows(needle.len()).position(|w| w == needle).expect("tensor info present") + needle.len()
}

fn parse_err(bytes: &[u8]) -> GgufError {
    Gguf::parse(bytes).expect_err("corrupt file must not parse")
}

#[test]
fn rejects_corrupt_synthetic_files_with_typed_errors() {
    let good = small_file(3);
    let patch = |at: usize, with: &[u8]| {
        let mut b = good.clone();
        b[at..at + with.len()].copy_from_slice(with);
        b
    };
    assert!(matches!(parse_err(&patch(0, b"GGUG")), GgufError::BadMagic { found } if &found == b"GGUG"));
    assert_eq!(parse_err(&patch(4, &1u32.to_le_bytes())), GgufError::UnsupportedVersion { version: 1 });
    assert_eq!(parse_err(&patch(4, &4u32.to_le_bytes())), GgufError::UnsupportedVersion { version: 4 });
    assert!(matches!(parse_err(&patch(8, &u64::MAX.to_le_bytes())), GgufError::CountTooLarge { offset: 8, .. }));
    assert!(matches!(parse_err(&patch(16, &(1u64 << 40).to_le_bytes())), GgufError::CountTooLarge { offset: 16, .. }));
    // First key's length larger than the file.
    assert!(matches!(parse_err(&patch(24, &(1u64 << 50).to_le_bytes())), GgufError::Truncated { offset: 32, .. }));
    // First value's type (after the 2-byte key "u8").
    assert!(matches!(
        parse_err(&patch(34, &77u32.to_le_bytes())),
        GgufError::UnknownValueType { offset: 34, value_type: 77 }
    ));
    // Invalid UTF-8 in the first key.
    assert!(matches!(parse_err(&patch(32, &[0xff])), GgufError::InvalidUtf8 { offset: 32 }));

    let a = tensor_info_at(&good, "a.weight"); // n_dims, dims, type, offset follow
    assert!(matches!(parse_err(&patch(a, &9u32.to_le_bytes())), GgufError::TooManyDims { n_dims: 9, .. }));
    assert!(matches!(parse_err(&patch(a + 4, &0u64.to_le_bytes())), GgufError::BadShape { .. }));
    assert!(matches!(
        parse_err(&patch(a + 4, &16u64.to_le_bytes())),
        GgufError::ShapeNotBlockAligned { block: 32, .. }
    ));
    assert!(matches!(
        parse_err(&patch(a + 12, &99u32.to_le_bytes())),
        GgufError::UnknownTensorType { type_id: 99, .. }
    ));
    assert!(matches!(parse_err(&patch(a + 16, &(1u64 << 20).to_le_bytes())), GgufError::TensorOutOfBounds { .. }));
    assert!(matches!(
        parse_err(&patch(a + 16, &u64::MAX.to_le_bytes())),
        GgufError::MisalignedTensor { .. } | GgufError::TensorOutOfBounds { .. }
    ));
    assert!(matches!(parse_err(&patch(a + 16, &1u64.to_le_bytes())), GgufError::MisalignedTensor { offset: 1, .. }));
    // b.weight moved onto a.weight's data.
    let b = tensor_info_at(&good, "b.weight");
    assert!(matches!(parse_err(&patch(b + 4 + 16 + 4, &0u64.to_le_bytes())), GgufError::TensorsOverlap { .. }));
    // Same name twice.
    let dup = patch(b - 8, b"a");
    assert!(matches!(parse_err(&dup), GgufError::DuplicateTensor { .. }));
}

#[test]
fn rejects_duplicate_keys_deep_nesting_and_bad_alignment() {
    let mut w = GgufWriter::new(3);
    w.metadata("k", Value::U8(1)).metadata("k", Value::U8(2));
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::DuplicateKey { .. }));

    let mut nested = Array::U8(vec![0]);
    for _ in 1..20 {
        nested = Array::Array(vec![nested]);
    }
    let mut w = GgufWriter::new(3);
    w.metadata("deep", Value::List(nested));
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::NestingTooDeep { .. }));

    let mut w = GgufWriter::new(3);
    w.metadata("general.alignment", Value::U32(48));
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::BadAlignment { alignment: 48 }));
}

#[test]
fn every_truncation_of_the_real_model_is_an_error() {
    let bytes = common::model_bytes();
    let g = Gguf::parse(bytes).unwrap();
    let header_end = g.data_offset as usize;
    let mut cuts = vec![0, 1, 3, 4, 7, 8, 15, 16, 23, 24, 31, 40, 100, 1000, 10_000, 100_000, 1_000_000];
    cuts.extend([header_end / 2, header_end - 1, header_end, header_end + 1, bytes.len() / 2, bytes.len() - 1]);
    cuts.extend((1..10).map(|i| header_end * i / 10 + 7));
    for cut in cuts {
        let err = Gguf::parse(&bytes[..cut]).expect_err("truncated file must not parse");
        let msg = err.to_string();
        assert!(msg.contains("offset") || msg.contains("data section"), "cut at {cut}: {msg}");
    }
}

#[test]
fn flipped_header_bytes_of_the_real_model_are_errors() {
    let mut bytes = common::model_bytes().to_vec();
    let g = Gguf::parse(&bytes).unwrap();
    let first = &g.tensors[0];
    let t = tensor_info_at(&bytes, &first.name);
    let n_dims = first.shape.len();
    let type_at = t + 4 + 8 * n_dims;
    let mut flips: Vec<(usize, u8)> = vec![
        (0, 0xff),               // magic
        (3, 0x01),               // magic
        (4, 0x07),               // version
        (5, 0x01),               // version
        (15, 0x80),              // tensor count
        (13, 0x10),              // tensor count
        (23, 0x40),              // metadata count
        (21, 0x01),              // metadata count
        (31, 0x20),              // first key length
        (28, 0x01),              // first key length
        (t, 0x08),               // n_dims
        (t + 4 + 7, 0x10),       // first dimension
        (type_at, 0x40),         // tensor type
        (type_at + 4 + 6, 0x01), // data offset far out of the file
        (type_at + 4, 0x01),     // data offset misaligned
    ];
    // The type of the first metadata value.
    let key_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    flips.push((32 + key_len, 0x40));
    flips.push((32 + key_len + 3, 0x01));
    // The last tensor's data offset pushed past the end of the file.
    let last = g.tensors.iter().max_by_key(|t| t.file_offset).unwrap();
    let l = tensor_info_at(&bytes, &last.name) + 4 + 8 * last.shape.len() + 4;
    flips.push((l + 5, 0x10));
    // The last tensor's rows grown by 65536 elements: its data would run past the file.
    flips.push((tensor_info_at(&bytes, &last.name) + 4 + 2, 0x01));
    assert!(flips.len() >= 19);
    for (at, mask) in flips {
        let old = bytes[at];
        bytes[at] ^= mask;
        let result = Gguf::parse(&bytes);
        bytes[at] = old;
        let err = result.err().unwrap_or_else(|| panic!("flip at {at} parsed"));
        assert!(!err.to_string().is_empty());
    }
    Gguf::parse(&bytes).expect("restored file parses again");
}

#[test]
fn arrays_are_typed_vectors_read_by_index_or_in_order() {
    let tokens = Array::from(vec!["a", "", "héllo"]);
    let mut w = GgufWriter::new(3);
    w.metadata("tokens", Value::List(tokens.clone()));
    w.metadata("ids", Value::List(Array::I32(vec![3, -1])));
    w.metadata("nested", Value::List(Array::Array(vec![Array::U8(vec![1, 2]), tokens.clone()])));
    let g = Gguf::parse(&w.to_bytes()).unwrap();

    let t = g.get_array("tokens").unwrap().unwrap();
    assert_eq!(t, &tokens);
    assert_eq!((t.len(), t.elem_type_id()), (3, 8));
    assert_eq!(t.iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>(), ["a", "", "héllo"]);
    assert_eq!(t.as_strings().unwrap().get(2), Some("héllo"));
    assert_eq!(t.get(3), None);

    let ids = g.get_array("ids").unwrap().unwrap();
    assert_eq!(ids.get(1), Some(ValueRef::I32(-1)));
    assert_eq!((ids.get(0).unwrap().as_u64(), ids.get(1).unwrap().as_u64()), (Some(3), None));
    assert_eq!((ids.get(1).unwrap().type_name(), ids.as_strings()), ("i32", None));

    let nested = g.get_array("nested").unwrap().unwrap();
    assert_eq!(nested.get(0).unwrap().as_array(), Some(&Array::U8(vec![1, 2])));
    assert_eq!(nested.get(1).unwrap().as_array().unwrap().get(0), Some(ValueRef::String("a")));

    // A missing array reads as an empty one where callers want a default.
    assert!(g.get_array("absent").unwrap().unwrap_or_default().is_empty());
    assert!(matches!(g.get_array("absent"), Ok(None)));
    assert!(matches!(
        Gguf::parse(&small_file(3)).unwrap().get_array("u8"),
        Err(GgufError::WrongValueType { expected: "array", found: "u8", .. })
    ));
}
