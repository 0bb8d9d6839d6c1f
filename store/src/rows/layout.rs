//! One row as a record of `u32` words in a slab chunk, and the precision
//! its values are stored in.
//!
//! ```text
//! key (2 words, low first) | steps (1 word, where kept) | stamp (1 word, where kept) | values | optimizer state
//! ```
//!
//! Values are `f32`, or with `storage = "f16"` / `"bf16"` two per word
//! (IEEE half, or the top half of an `f32`), widened to `f32` for every
//! use: optimizer math runs in `f32` on the widened row and the result is
//! rounded once per update; a Fetch answers `f32`.
//!
//! The optimizer state (Adagrad's accumulator, Adam's moments) of a
//! narrow table is stored as `bf16`, whatever the values' format: it has
//! `f32`'s range (Adam's second moment of a gradient of 1e-4 is 1e-8,
//! below `f16`'s smallest normal number, and a moment flushed to zero
//! would divide a step by epsilon).
//!
//! Rounding is **stochastic**: a value between two neighbours of the
//! narrow format becomes the upper one with probability equal to its
//! distance from the lower one, so a stored value is the exact one on
//! average. Rounding to nearest loses every update smaller than half a
//! unit in the last place for good: in `f16`, any step below 1/2048 of
//! the value (SGD at a small learning rate stops learning), and Adam's
//! second moment, which moves by a thousandth per step (`beta2 =
//! 0.999`), below `bf16`'s resolution (1/128), would never move. The draw
//! is not random but a hash of the row's key, the value's index and the
//! exact result: replicas applying the same Push round alike and stay
//! bit-identical. The Push's identity (its worker and sequence, which the
//! replicas apply with it) is mixed in as a seed, so that a value the
//! same small step keeps nudging draws afresh each time instead of
//! repeating the draw that kept it in place.
//!
//! `stamp` (when the row was last pushed, or touched, in the table's
//! expiry clock: `table/expiry.rs`) is kept for a table with expiry only.
//!
//! `steps` (updates applied) is kept where it is used: Adam's bias
//! correction and LFU eviction. An SGD or Adagrad row without a row limit
//! under LFU does not carry it (it reads as 0 in a checkpoint or a copy).
//!
//! The words are read and written through `bytemuck` casts (`u32` to
//! `f32` or `half::f16`, both plain old data): no `unsafe` here.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use tessera_proto::sharding::splitmix64;

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

    /// The value `v` (value `index` of the row of `key`) becomes when
    /// stored outside a Push (a new row's initial values; module docs).
    pub fn round(self, key: u64, index: usize, v: f32) -> f32 {
        let salt = salt(key, 0);
        match self {
            Storage::F32 => v,
            Storage::F16 => f16::from_bits(round_f16(salt, index, v)).to_f32(),
            Storage::Bf16 => bf16::from_bits(round_bf16(salt, index, v)).to_f32(),
        }
    }
}

/// The draws' salt for the row of `key` under a Push seeded `seed`.
fn salt(key: u64, seed: u64) -> u64 {
    key ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93)
}

/// The draw for rounding value `index` of a row (salted by its key and
/// the Push) to `v`: 64 bits of a hash of all three.
fn draw(salt: u64, index: usize, v: f32) -> u64 {
    splitmix64(
        salt ^ (index as u64).rotate_left(48)
            ^ u64::from(v.to_bits()).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    )
}

/// `v` as bfloat16 bits, rounded stochastically: the 16 bits dropped are
/// compared with 16 drawn ones (a carry rounds the magnitude up).
fn round_bf16(salt: u64, index: usize, v: f32) -> u16 {
    if v.is_nan() {
        return bf16::from_f32(v).to_bits();
    }
    let bits = v.to_bits();
    // Below infinity's bits nothing carries into the sign; infinity's low
    // bits are zero and stay so.
    (bits.saturating_add((draw(salt, index, v) & 0xffff) as u32) >> 16) as u16
}

/// `v` as IEEE half bits, rounded stochastically between its two
/// neighbours.
fn round_f16(salt: u64, index: usize, v: f32) -> u16 {
    let nearest = f16::from_f32(v);
    let back = nearest.to_f32();
    if back == v || !v.is_finite() || back.is_infinite() {
        return nearest.to_bits();
    }
    // The neighbour on v's other side: one unit further from zero or
    // nearer to it (half bits order magnitudes like integers; `back` is
    // not zero when it lies further from zero than `v`).
    let other = if back.abs() < v.abs() {
        nearest.to_bits() + 1
    } else {
        nearest.to_bits() - 1
    };
    let other_value = f16::from_bits(other).to_f32();
    let (lo, hi, lo_bits, hi_bits) = if back < other_value {
        (back, other_value, nearest.to_bits(), other)
    } else {
        (other_value, back, other, nearest.to_bits())
    };
    // P(hi) = (v - lo) / (hi - lo), from 24 drawn bits.
    let p = (v - lo) / (hi - lo);
    let u = (draw(salt, index, v) >> 40) as f32 / (1u32 << 24) as f32;
    if u < p { hi_bits } else { lo_bits }
}

/// `bf16` words as `f32` into `out`.
fn widen_bf16(words: &[u32], out: &mut [f32]) {
    let narrow: &[bf16] = bytemuck::cast_slice(words);
    for (o, v) in out.iter_mut().zip(narrow) {
        *o = v.to_f32();
    }
}

/// Where the parts of a row lie in its record (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    dim: usize,
    state: usize,
    storage: Storage,
    steps: bool,
    stamp: bool,
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
            stamp: false,
        }
    }

    /// The same layout with a `stamp` word (a table with expiry).
    pub fn with_stamp(self) -> Self {
        Self {
            stamp: true,
            ..self
        }
    }

    /// Whether `stamp` is kept.
    pub fn keeps_stamp(&self) -> bool {
        self.stamp
    }

    fn stamp_at(&self) -> usize {
        KEY_WORDS + usize::from(self.steps)
    }

    /// The row's expiry stamp (0 where not kept).
    pub fn stamp(&self, record: &[u32]) -> u32 {
        if self.stamp {
            record[self.stamp_at()]
        } else {
            0
        }
    }

    /// Sets the row's expiry stamp (nothing where not kept).
    pub fn set_stamp(&self, record: &mut [u32], stamp: u32) {
        if self.stamp {
            record[self.stamp_at()] = stamp;
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
        KEY_WORDS + usize::from(self.steps) + usize::from(self.stamp)
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

    fn state_words(&self) -> usize {
        match self.storage {
            Storage::F32 => self.state,
            Storage::F16 | Storage::Bf16 => self.state.div_ceil(2),
        }
    }

    /// Words from a record's start through its values: what a Fetch
    /// reads (the key, to check it, and the values).
    pub fn fetch_words(&self) -> usize {
        self.state_at()
    }

    /// Words of one record.
    pub fn words(&self) -> usize {
        self.state_at() + self.state_words()
    }

    /// The key of `record`.
    #[inline]
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

    /// The optimizer state as `f32`, into `out` (`state_len` long).
    pub fn read_state(&self, record: &[u32], out: &mut [f32]) {
        let words = &record[self.state_at()..self.words()];
        match self.storage {
            Storage::F32 => out.copy_from_slice(bytemuck::cast_slice(words)),
            Storage::F16 | Storage::Bf16 => widen_bf16(words, out),
        }
    }

    /// Appends the optimizer state as little-endian `f32`s to `out`.
    pub fn write_state_le(&self, record: &[u32], out: &mut Vec<u8>) {
        let words = &record[self.state_at()..self.words()];
        match self.storage {
            Storage::F32 => {
                for w in words {
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
            Storage::F16 | Storage::Bf16 => {
                let narrow: &[bf16] = bytemuck::cast_slice(words);
                for v in &narrow[..self.state] {
                    out.extend_from_slice(&v.to_f32().to_le_bytes());
                }
            }
        }
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
            // Stored as their bits: on a little-endian machine the row is
            // its wire form, one copy.
            Storage::F32 if cfg!(target_endian = "little") => {
                let n = out.len().min(words.len() * 4);
                out[..n].copy_from_slice(&bytemuck::cast_slice(words)[..n]);
            }
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
        let (state_at, words) = (self.state_at(), self.words());
        let salt = salt(key, 0);
        self.narrow_state(&mut record[state_at..words], state, salt);
    }

    fn narrow_state(&self, words: &mut [u32], state: &[f32], salt: u64) {
        match self.storage {
            Storage::F32 => bytemuck::cast_slice_mut::<u32, f32>(words).copy_from_slice(state),
            Storage::F16 | Storage::Bf16 => {
                let narrow: &mut [u16] = bytemuck::cast_slice_mut(words);
                for (j, (n, v)) in narrow.iter_mut().zip(state).enumerate() {
                    *n = round_bf16(salt, self.dim + j, *v);
                }
            }
        }
    }

    /// Stores `values` (rounded to the storage).
    fn write_values(&self, record: &mut [u32], values: &[f32]) {
        let (at, end) = (self.values_at(), self.state_at());
        let salt = salt(self.key(record), 0);
        self.narrow(&mut record[at..end], values, salt);
    }

    /// Runs `update` on the row as `f32`: values (in place with `f32`
    /// storage, else widened into `scratch` and rounded back after),
    /// optimizer state, and steps (a scratch counter where not kept).
    /// Narrow values are rounded with draws seeded by `seed` (the Push's
    /// identity, 0 for none) and the row's key.
    pub fn update<R>(
        &self,
        record: &mut [u32],
        scratch: &mut Vec<f32>,
        seed: u64,
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> R {
        let (values_at, state_at, words) = (self.values_at(), self.state_at(), self.words());
        let salt = salt(self.key(record), seed);
        let mut no_steps = 0;
        let (head, rest) = record.split_at_mut(values_at);
        let steps = if self.steps {
            &mut head[KEY_WORDS]
        } else {
            &mut no_steps
        };
        let (values, state) = rest.split_at_mut(state_at - values_at);
        let state = &mut state[..words - state_at];
        match self.storage {
            Storage::F32 => update(
                bytemuck::cast_slice_mut(values),
                bytemuck::cast_slice_mut(state),
                steps,
            ),
            Storage::F16 | Storage::Bf16 => {
                scratch.resize(self.dim + self.state, 0.0);
                let (wide_values, wide_state) = scratch.split_at_mut(self.dim);
                self.widen(values, wide_values);
                widen_bf16(state, wide_state);
                let out = update(wide_values, wide_state, steps);
                self.narrow(values, wide_values, salt);
                self.narrow_state(state, wide_state, salt);
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
            Storage::Bf16 => widen_bf16(words, out),
        }
    }

    /// `values` rounded to the storage into the value words `words`.
    /// (Rounded stochastically, drawn from `salt`: module docs.)
    fn narrow(&self, words: &mut [u32], values: &[f32], salt: u64) {
        match self.storage {
            Storage::F32 => bytemuck::cast_slice_mut::<u32, f32>(words).copy_from_slice(values),
            Storage::F16 => {
                let narrow: &mut [u16] = bytemuck::cast_slice_mut(words);
                for (i, (n, v)) in narrow.iter_mut().zip(values).enumerate() {
                    *n = round_f16(salt, i, *v);
                }
            }
            Storage::Bf16 => {
                let narrow: &mut [u16] = bytemuck::cast_slice_mut(words);
                for (i, (n, v)) in narrow.iter_mut().zip(values).enumerate() {
                    *n = round_bf16(salt, i, *v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every draw gives one of the two neighbours, exact values stay
    /// exact, and the mean over many rows is the value itself.
    #[test]
    fn stochastic_rounding_picks_a_neighbour_and_is_unbiased() {
        for storage in [Storage::F16, Storage::Bf16] {
            for v in [0.1f32, -0.1, 1.0 + 1e-4, -3.3e-6, 1000.3, 7e-8, 1.5, -0.0] {
                let nearest = match storage {
                    Storage::F16 => f16::from_f32(v).to_f32(),
                    _ => bf16::from_f32(v).to_f32(),
                };
                let n = 20_000;
                let mut sum = 0f64;
                for key in 0..n {
                    let r = storage.round(key, 3, v);
                    if nearest == v {
                        assert_eq!(r.to_bits(), v.to_bits(), "{storage:?} {v} is exact");
                    }
                    // r is one of the two narrow values around v.
                    assert!(
                        r == nearest || (r - v).signum() != (nearest - v).signum(),
                        "{storage:?}: {v} became {r}, not a neighbour"
                    );
                    let gap = (r - nearest).abs();
                    assert!(
                        gap == 0.0 || gap <= 2.0 * (v - nearest).abs() + v.abs() * 0.008 + 1.2e-7,
                        "{storage:?}: {v} became {r}, nearest {nearest}"
                    );
                    sum += f64::from(r);
                }
                let mean = sum / n as f64;
                let gap = (f64::from(nearest) - f64::from(v)).abs().max(1e-12);
                assert!(
                    (mean - f64::from(v)).abs() <= gap * 0.1 + 1e-12,
                    "{storage:?}: the mean of {v} rounded is {mean}"
                );
            }
            assert!(storage.round(1, 0, f32::NAN).is_nan());
            assert_eq!(storage.round(1, 0, f32::INFINITY), f32::INFINITY);
        }
    }

    /// Replicas round alike: the draw depends on the key, the index and
    /// the value only.
    #[test]
    fn the_same_value_of_the_same_row_rounds_alike() {
        for storage in [Storage::F16, Storage::Bf16] {
            for i in 0..100 {
                let v = 0.123_456 + i as f32 * 1e-5;
                assert_eq!(
                    storage.round(42, i, v).to_bits(),
                    storage.round(42, i, v).to_bits()
                );
            }
        }
    }
}
