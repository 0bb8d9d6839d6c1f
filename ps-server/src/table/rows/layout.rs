//! One row as a record of `u32` words in a slab chunk, and the precision
//! its values are stored in.
//!
//! ```text
//! key (2 words, low first) | steps (1 word, where kept) | values | optimizer state
//! ```
//!
//! Values are `f32`, or with `storage = "f16"` / `"bf16"` two per word
//! (IEEE half, or the top half of an `f32`), rounded to nearest-even when
//! written and widened to `f32` for every use: optimizer math runs in
//! `f32` on the widened row and the result is rounded once per update; a
//! Fetch answers `f32`. The optimizer state (Adagrad's accumulator, Adam's
//! moments) stays `f32` whatever the storage: Adam's second moment moves
//! by a thousandth per step (`beta2 = 0.999`), below the resolution of
//! `bf16` (1/128) and, for small gradients, below `f16`'s smallest
//! normal number, so a narrow copy would stop following the gradients.
//!
//! `steps` (updates applied) is kept where it is used: Adam's bias
//! correction and LFU eviction. An SGD or Adagrad row without a row limit
//! under LFU does not carry it (it reads as 0 in a checkpoint or a copy).
//!
//! The words are read and written through `bytemuck` casts (`u32` to
//! `f32` or `half::f16`, both plain old data): no `unsafe` here.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// How a table stores its values (optimizer state is always `f32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    /// 32-bit floats: exactly what was computed.
    #[default]
    F32,
    /// IEEE 754 half precision: 11 significant bits (a relative rounding
    /// error of at most 2^-11), values up to 65,504, smaller than about
    /// 6e-8 flush to zero.
    F16,
    /// bfloat16: the range of `f32` with 8 significant bits (a relative
    /// rounding error of at most 2^-8).
    Bf16,
}

impl Storage {
    /// The name, as configured.
    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::Bf16 => "bf16",
        }
    }

    /// The value `v` becomes when stored (rounded to nearest-even).
    pub fn round(self, v: f32) -> f32 {
        match self {
            Storage::F32 => v,
            Storage::F16 => f16::from_f32(v).to_f32(),
            Storage::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
}

/// Where the parts of a row lie in its record (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    dim: usize,
    state: usize,
    storage: Storage,
    steps: bool,
}

/// Words of the key.
const KEY_WORDS: usize = 2;

impl RowLayout {
    /// A row of `dim` values stored as `storage`, `state` values of
    /// optimizer state, with or without a `steps` word.
    pub fn new(dim: usize, state: usize, storage: Storage, steps: bool) -> Self {
        Self {
            dim,
            state,
            storage,
            steps,
        }
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Optimizer state values per row.
    pub fn state_len(&self) -> usize {
        self.state
    }

    /// The storage of the values.
    pub fn storage(&self) -> Storage {
        self.storage
    }

    fn values_at(&self) -> usize {
        KEY_WORDS + usize::from(self.steps)
    }

    fn value_words(&self) -> usize {
        match self.storage {
            Storage::F32 => self.dim,
            Storage::F16 | Storage::Bf16 => self.dim.div_ceil(2),
        }
    }

    fn state_at(&self) -> usize {
        self.values_at() + self.value_words()
    }

    /// Words of one record.
    pub fn words(&self) -> usize {
        self.state_at() + self.state
    }

    /// The key of `record`.
    pub fn key(&self, record: &[u32]) -> u64 {
        u64::from(record[0]) | (u64::from(record[1]) << 32)
    }

    /// Sets the key of `record`.
    pub fn set_key(&self, record: &mut [u32], key: u64) {
        record[0] = key as u32;
        record[1] = (key >> 32) as u32;
    }

    /// Updates applied (0 where not kept).
    pub fn steps(&self, record: &[u32]) -> u32 {
        if self.steps { record[KEY_WORDS] } else { 0 }
    }

    /// Whether `steps` is kept.
    pub fn keeps_steps(&self) -> bool {
        self.steps
    }

    /// The optimizer state.
    pub fn state<'r>(&self, record: &'r [u32]) -> &'r [f32] {
        bytemuck::cast_slice(&record[self.state_at()..self.words()])
    }

    /// The values as `f32`, into `out` (`dim` long).
    pub fn read_values(&self, record: &[u32], out: &mut [f32]) {
        self.widen(&record[self.values_at()..self.state_at()], out);
    }

    /// The values as little-endian `f32` bytes into `out` (`4 * dim`
    /// long): a Fetch's answer.
    pub fn write_values_le(&self, record: &[u32], out: &mut [u8]) {
        let words = &record[self.values_at()..self.state_at()];
        match self.storage {
            Storage::F32 => {
                for (o, w) in out.chunks_exact_mut(4).zip(words) {
                    o.copy_from_slice(&w.to_le_bytes());
                }
            }
            Storage::F16 => {
                let narrow: &[f16] = bytemuck::cast_slice(words);
                for (o, v) in out.chunks_exact_mut(4).zip(narrow) {
                    o.copy_from_slice(&v.to_f32().to_le_bytes());
                }
            }
            Storage::Bf16 => {
                let narrow: &[bf16] = bytemuck::cast_slice(words);
                for (o, v) in out.chunks_exact_mut(4).zip(narrow) {
                    o.copy_from_slice(&v.to_f32().to_le_bytes());
                }
            }
        }
    }

    /// Writes a whole row: `key`, `steps`, `values` (rounded to the
    /// storage) and `state`.
    pub fn write(&self, record: &mut [u32], key: u64, steps: u32, values: &[f32], state: &[f32]) {
        self.set_key(record, key);
        if self.steps {
            record[KEY_WORDS] = steps;
        }
        self.write_values(record, values);
        let state_at = self.state_at();
        let words = self.words();
        bytemuck::cast_slice_mut::<u32, f32>(&mut record[state_at..words]).copy_from_slice(state);
    }

    /// Stores `values` (rounded to the storage).
    fn write_values(&self, record: &mut [u32], values: &[f32]) {
        let (at, end) = (self.values_at(), self.state_at());
        self.narrow(&mut record[at..end], values);
    }

    /// Runs `update` on the row as `f32`: values (in place with `f32`
    /// storage, else widened into `scratch` and rounded back after),
    /// optimizer state, and steps (a scratch counter where not kept).
    pub fn update<R>(
        &self,
        record: &mut [u32],
        scratch: &mut Vec<f32>,
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> R {
        let (values_at, state_at, words) = (self.values_at(), self.state_at(), self.words());
        let mut no_steps = 0;
        let (head, rest) = record.split_at_mut(values_at);
        let steps = if self.steps {
            &mut head[KEY_WORDS]
        } else {
            &mut no_steps
        };
        let (values, state) = rest.split_at_mut(state_at - values_at);
        let state: &mut [f32] = bytemuck::cast_slice_mut(&mut state[..words - state_at]);
        match self.storage {
            Storage::F32 => update(bytemuck::cast_slice_mut(values), state, steps),
            Storage::F16 | Storage::Bf16 => {
                scratch.resize(self.dim, 0.0);
                self.widen(values, scratch);
                let out = update(scratch, state, steps);
                self.narrow(values, scratch);
                out
            }
        }
    }

    /// The value words `words` as `f32` into `out`.
    fn widen(&self, words: &[u32], out: &mut [f32]) {
        match self.storage {
            Storage::F32 => out.copy_from_slice(bytemuck::cast_slice(words)),
            Storage::F16 => {
                let narrow: &[f16] = bytemuck::cast_slice(words);
                for (o, v) in out.iter_mut().zip(narrow) {
                    *o = v.to_f32();
                }
            }
            Storage::Bf16 => {
                let narrow: &[bf16] = bytemuck::cast_slice(words);
                for (o, v) in out.iter_mut().zip(narrow) {
                    *o = v.to_f32();
                }
            }
        }
    }

    /// `values` rounded to the storage into the value words `words`.
    fn narrow(&self, words: &mut [u32], values: &[f32]) {
        match self.storage {
            Storage::F32 => bytemuck::cast_slice_mut::<u32, f32>(words).copy_from_slice(values),
            Storage::F16 => {
                let narrow: &mut [f16] = bytemuck::cast_slice_mut(words);
                for (n, v) in narrow.iter_mut().zip(values) {
                    *n = f16::from_f32(*v);
                }
            }
            Storage::Bf16 => {
                let narrow: &mut [bf16] = bytemuck::cast_slice_mut(words);
                for (n, v) in narrow.iter_mut().zip(values) {
                    *n = bf16::from_f32(*v);
                }
            }
        }
    }
}
