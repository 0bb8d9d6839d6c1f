//! NumPy arrays in and out.
//!
//! In: keys are a 1-D `uint64` array and gradients a 2-D `float32` array of
//! shape `(len(keys), dim)` (the Python layer converts anything else, once,
//! and says so in its docs). They are read in place while the interpreter
//! lock is held, straight into the plan's per-shard sub-requests; the lock
//! is released only once the plan owns everything it sends. (Reading the
//! arrays after releasing the lock would race with any Python thread that
//! writes to them.)
//!
//! Out: a Fetch's rows are merged from the shards' answers into one block
//! in the caller's key order, and that block becomes the array's buffer
//! as it is: exactly one copy from the receive buffers, none after. The
//! receive buffers themselves are not handed out, on purpose: rows of
//! several shards (and repeated keys) have to be gathered into the
//! caller's order anyway, and an array a trainer keeps for a step would
//! pin the transport's receive memory (RDMA receive credits) for as long
//! as it lives.

use std::borrow::Cow;

use ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use tessera_worker::Rows;

/// The keys of `array`, in place when it is contiguous.
pub(crate) fn keys<'a>(array: &'a PyReadonlyArray1<'_, u64>) -> Cow<'a, [u64]> {
    match array.as_slice() {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(array.as_array().iter().copied().collect()),
    }
}

/// The gradients of `array` row after row, and its row length, in place
/// when it is C-contiguous.
pub(crate) fn gradients<'a>(array: &'a PyReadonlyArray2<'_, f32>) -> (Cow<'a, [f32]>, usize) {
    let dim = array.shape()[1];
    let values = match array.as_slice() {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(array.as_array().iter().copied().collect()),
    };
    (values, dim)
}

/// Fetched rows on their way to Python: a `float32` array of shape
/// `(len(keys), dim)` that takes over the rows' block without copying it.
pub(crate) struct RowsArray(pub(crate) Rows);

impl<'py> IntoPyObject<'py> for RowsArray {
    type Target = PyArray2<f32>;
    type Output = Bound<'py, PyArray2<f32>>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        let (rows, dim) = (self.0.len(), self.0.dim());
        let block = Array2::from_shape_vec((rows, dim), self.0.into_values()).map_err(|err| {
            crate::errors::status_error(
                py,
                tessera_rpc::Code::Internal,
                format!("rows do not fit their shape: {err}"),
            )
        })?;
        Ok(block.into_pyarray(py))
    }
}
