//! In-memory weight storage. Tensors stay inside the checkpoint's memory map where alignment
//! allows; quantised matrices keep their packed codes and per-group scales/biases as stored.

use std::sync::Arc;

use bytemuck::Pod;
use half::{bf16, f16};
use memmap2::Mmap;

/// A typed, read-only buffer: a window of a memory-mapped file, or owned memory when the window
/// is misaligned for `T` or the data had to be converted.
#[derive(Clone)]
pub struct Buf<T: Pod> {
    inner: BufInner<T>,
}

#[derive(Clone)]
enum BufInner<T: Pod> {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Arc<Vec<T>>),
}

impl<T: Pod> Buf<T> {
    /// `len` elements of `T` at byte offset `start` of `map`.
    pub fn mapped(map: &Arc<Mmap>, start: usize, len: usize) -> Self {
        let bytes = &map[start..start + len * std::mem::size_of::<T>()];
        if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            Buf {
                inner: BufInner::Mapped {
                    map: map.clone(),
                    start,
                    len,
                },
            }
        } else {
            Buf::owned(bytemuck::pod_collect_to_vec(bytes))
        }
    }
    pub fn owned(v: Vec<T>) -> Self {
        Buf {
            inner: BufInner::Owned(Arc::new(v)),
        }
    }
    pub fn as_slice(&self) -> &[T] {
        match &self.inner {
            BufInner::Mapped { map, start, len } => {
                bytemuck::cast_slice(&map[*start..*start + len * std::mem::size_of::<T>()])
            }
            BufInner::Owned(v) => v,
        }
    }
    pub fn len(&self) -> usize {
        match &self.inner {
            BufInner::Mapped { len, .. } => *len,
            BufInner::Owned(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn byte_len(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
    pub fn is_mapped(&self) -> bool {
        matches!(self.inner, BufInner::Mapped { .. })
    }
}

/// Floating-point data as stored: bf16, f16 or f32.
#[derive(Clone)]
pub enum FloatBuf {
    Bf16(Buf<u16>),
    F16(Buf<u16>),
    F32(Buf<f32>),
}

impl FloatBuf {
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            FloatBuf::Bf16(b) => bf16::from_bits(b.as_slice()[i]).to_f32(),
            FloatBuf::F16(b) => f16::from_bits(b.as_slice()[i]).to_f32(),
            FloatBuf::F32(b) => b.as_slice()[i],
        }
    }
    /// Converts `[start, start + out.len())` to f32.
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            FloatBuf::Bf16(b) => {
                for (o, &x) in out.iter_mut().zip(&b.as_slice()[start..start + n]) {
                    *o = f32::from_bits((x as u32) << 16);
                }
            }
            FloatBuf::F16(b) => {
                for (o, &x) in out.iter_mut().zip(&b.as_slice()[start..start + n]) {
                    *o = f16::from_bits(x).to_f32();
                }
            }
            FloatBuf::F32(b) => out.copy_from_slice(&b.as_slice()[start..start + n]),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len()];
        self.read_into(0, &mut v);
        v
    }
    pub fn len(&self) -> usize {
        match self {
            FloatBuf::Bf16(b) | FloatBuf::F16(b) => b.len(),
            FloatBuf::F32(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn byte_len(&self) -> usize {
        match self {
            FloatBuf::Bf16(b) | FloatBuf::F16(b) => b.byte_len(),
            FloatBuf::F32(b) => b.byte_len(),
        }
    }
    pub fn dtype_name(&self) -> &'static str {
        match self {
            FloatBuf::Bf16(_) => "bf16",
            FloatBuf::F16(_) => "f16",
            FloatBuf::F32(_) => "f32",
        }
    }
}

/// How a matrix's elements are stored.
#[derive(Clone)]
pub enum MatrixData {
    /// MLX affine quantisation (model-spec §5.5): row-major packed little-endian u32 words,
    /// element `j` of a row is bits `[(j % per_word) * bits, ...)` of word `j / per_word`;
    /// one scale and bias per `group` consecutive elements of a row.
    Quantized {
        bits: u32,
        group: usize,
        codes: Buf<u32>,
        scales: FloatBuf,
        biases: FloatBuf,
    },
    /// Plain row-major floating-point weights.
    Dense(FloatBuf),
}

/// A row-major `[rows, cols]` matrix (a stack of expert matrices is flattened to `[E*rows, cols]`).
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    pub fn storage_bytes(&self) -> usize {
        match &self.data {
            MatrixData::Quantized {
                codes,
                scales,
                biases,
                ..
            } => codes.byte_len() + scales.byte_len() + biases.byte_len(),
            MatrixData::Dense(d) => d.byte_len(),
        }
    }
    /// u32 words per row for quantised storage.
    pub fn words_per_row(&self) -> usize {
        match &self.data {
            MatrixData::Quantized { bits, .. } => self.cols * *bits as usize / 32,
            MatrixData::Dense(_) => 0,
        }
    }
    /// Writes row `r` as f32 into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.cols);
        match &self.data {
            MatrixData::Dense(d) => d.read_into(r * self.cols, out),
            MatrixData::Quantized {
                bits,
                group,
                codes,
                scales,
                biases,
            } => {
                let wpr = self.words_per_row();
                let words = &codes.as_slice()[r * wpr..(r + 1) * wpr];
                let groups = self.cols / group;
                crate::quant::dequantize_words(
                    *bits,
                    words,
                    |g| scales.get(r * groups + g),
                    |g| biases.get(r * groups + g),
                    *group,
                    out,
                );
            }
        }
    }
}

/// A contiguous block of rows of a shared matrix: one projection, or one expert of a stack.
#[derive(Clone)]
pub struct Linear {
    pub matrix: Arc<Matrix>,
    pub row0: usize,
    pub rows: usize,
}

impl Linear {
    pub fn whole(m: Matrix) -> Self {
        let rows = m.rows;
        Linear {
            matrix: Arc::new(m),
            row0: 0,
            rows,
        }
    }
    pub fn cols(&self) -> usize {
        self.matrix.cols
    }
    pub fn rows_of(matrix: &Arc<Matrix>, row0: usize, rows: usize) -> Self {
        assert!(row0 + rows <= matrix.rows, "row window outside matrix");
        Linear {
            matrix: matrix.clone(),
            row0,
            rows,
        }
    }
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.matrix.dequantize_row(self.row0 + r, out)
    }
}
