//! `tessera._native.Client`: blocking and asyncio calls on one
//! [`PsClient`].
//!
//! Every call is two steps: with the interpreter lock held, the arrays are
//! read into a [`PlannedFetch`] / [`PlannedPush`] (see [`crate::arrays`]);
//! then the lock is released (`Python::detach`) while the runtime runs the
//! calls, or, for the `*_async` methods, the planned call becomes an
//! asyncio future (pyo3-async-runtimes) resolved on the caller's event
//! loop. Calls from many Python threads and coroutines run concurrently on
//! the same connections.

use std::sync::Arc;

use numpy::{PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tessera_proto::v1::HealthResponse;
use tessera_rpc::RpcError;
use tessera_worker::{
    PlannedFetch, PlannedPush, PsClient, PushId, PushSpec, WorkerConfig, WorkerError,
};

use crate::arrays::{self, RowsArray};
use crate::errors;
use crate::runtime;

/// A client of a sharded, replicated Tessera parameter server (wrapped by
/// `tessera.Client` and `tessera.AsyncClient`).
#[pyclass(frozen, module = "tessera._native")]
pub(crate) struct Client {
    inner: Arc<PsClient>,
    /// The process that made the client (see [`crate::runtime`]).
    pid: u32,
}

/// The configuration in the TOML file at `path` (as `worker --config`
/// reads it) or in `json` (the same keys, from a Python dict), with the
/// keys of `overrides` (JSON, as from a dict of keyword arguments) put
/// over it: a table's keys are merged, any other value replaced.
/// Validated by [`PsClient::new`].
fn parse_config(
    path: Option<&str>,
    json: Option<&str>,
    overrides: Option<&str>,
) -> Result<WorkerConfig, String> {
    let mut value: serde_json::Value = match (path, json) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).map_err(|err| format!("{path}: {err}"))?;
            toml::from_str(&text).map_err(|err| format!("{path}: {err}"))?
        }
        (None, Some(text)) => serde_json::from_str(text).map_err(|err| format!("config: {err}"))?,
        _ => return Err("pass exactly one of path= and json=".to_owned()),
    };
    if let Some(overrides) = overrides {
        let overrides: serde_json::Value =
            serde_json::from_str(overrides).map_err(|err| format!("overrides: {err}"))?;
        merge(&mut value, overrides);
    }
    serde_json::from_value(value).map_err(|err| format!("config: {err}"))
}

/// Puts `over` over `base`: objects are merged key by key, anything else
/// replaced.
fn merge(base: &mut serde_json::Value, over: serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(base), serde_json::Value::Object(over)) => {
            for (key, value) in over {
                match base.get_mut(&key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, over) => *base = over,
    }
}

impl Client {
    /// The runtime, refusing a forked child.
    fn runtime(&self, py: Python<'_>) -> PyResult<&'static tokio::runtime::Runtime> {
        runtime::check_process(self.pid).map_err(|err| errors::forked(py, err))?;
        runtime::get().map_err(|err| errors::forked(py, err))
    }

    /// Runs `call` on the runtime with the interpreter lock released.
    fn block_on<T, F>(&self, py: Python<'_>, call: F) -> PyResult<T>
    where
        T: Send,
        F: Future<Output = Result<T, WorkerError>> + Send,
    {
        let runtime = self.runtime(py)?;
        py.detach(|| runtime.block_on(call))
            .map_err(|err| errors::to_py(py, err))
    }

    /// `call` as an asyncio awaitable on the caller's running loop.
    fn future<'py, T, F>(&self, py: Python<'py>, call: F) -> PyResult<Bound<'py, PyAny>>
    where
        T: for<'a> IntoPyObject<'a> + Send + 'static,
        F: Future<Output = Result<T, WorkerError>> + Send + 'static,
    {
        self.runtime(py)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            call.await
                .map_err(|err| Python::attach(|py| errors::to_py(py, err)))
        })
    }

    fn plan_fetch(&self, table: &str, keys: &PyReadonlyArray1<'_, u64>) -> PlannedFetch {
        self.inner.plan_fetch(table, &arrays::keys(keys))
    }

    fn plan_push(
        &self,
        py: Python<'_>,
        specs: &[(String, PyReadonlyArray1<'_, u64>, PyReadonlyArray2<'_, f32>)],
    ) -> PyResult<PlannedPush> {
        let arrays: Vec<_> = specs
            .iter()
            .map(|(table, keys, gradients)| {
                let (values, dim) = arrays::gradients(gradients);
                (table.as_str(), arrays::keys(keys), values, dim)
            })
            .collect();
        for (table, keys, values, dim) in &arrays {
            if values.len() != keys.len() * dim {
                return Err(errors::invalid(
                    py,
                    format!(
                        "table {table}: gradients of shape ({}, {dim}) for {} keys",
                        values.len().checked_div(*dim).unwrap_or(0),
                        keys.len()
                    ),
                ));
            }
        }
        let specs: Vec<PushSpec<'_>> = arrays
            .iter()
            .map(|(table, keys, values, dim)| PushSpec {
                table,
                keys,
                gradients: values,
                dim: *dim,
            })
            .collect();
        self.inner
            .plan_push_many(&specs)
            .map_err(|err| errors::to_py(py, err))
    }

    fn push_id(&self, push_id: Option<u64>) -> PushId {
        push_id.map_or_else(|| self.inner.next_push_id(), PushId::from_sequence)
    }
}

#[pymethods]
impl Client {
    /// `Client(path=None, json=None, overrides=None)`: a client for the
    /// servers of a worker configuration, given as a TOML file or as JSON
    /// text of the same keys, with the keys of `overrides` (JSON) over it.
    #[new]
    #[pyo3(signature = (*, path = None, json = None, overrides = None))]
    fn new(
        py: Python<'_>,
        path: Option<&str>,
        json: Option<&str>,
        overrides: Option<&str>,
    ) -> PyResult<Self> {
        let config =
            parse_config(path, json, overrides).map_err(|message| errors::invalid(py, message))?;
        let runtime = runtime::get().map_err(|err| errors::forked(py, err))?;
        // Inside the runtime, so that the coordinator's watch and the
        // transport's completion-queue tasks start on it.
        let _entered = runtime.enter();
        let inner = PsClient::new(&config).map_err(|err| errors::to_py(py, err))?;
        Ok(Self {
            inner: Arc::new(inner),
            pid: std::process::id(),
        })
    }

    /// This client's id in Push deduplication.
    #[getter]
    fn worker_id(&self) -> u64 {
        self.inner.worker_id()
    }

    /// The number of shards.
    #[getter]
    fn num_shards(&self) -> u32 {
        self.inner.num_shards()
    }

    /// A fresh Push id.
    fn next_push_id(&self) -> u64 {
        self.inner.next_push_id().sequence()
    }

    /// The server `shard`'s Pushes go to now and its epoch, or None.
    fn primary(&self, shard: u32) -> Option<(String, u64)> {
        self.inner.primary(shard)
    }

    /// The servers `shard`'s Fetches avoid now (quarantined).
    fn quarantined(&self, shard: u32) -> Vec<String> {
        self.inner
            .replica_set(shard)
            .map(|set| set.quarantined().into_iter().map(|e| e.node).collect())
            .unwrap_or_default()
    }

    /// `[(address, transport)]` of `shard`'s replicas: `"tcp"`, `"rdma"` or
    /// None (not connected now).
    fn transports(&self, shard: u32) -> Vec<(String, Option<String>)> {
        self.inner
            .replica_set(shard)
            .map(|set| {
                set.transports()
                    .into_iter()
                    .map(|(addr, kind)| (addr, kind.map(|k| format!("{k:?}").to_lowercase())))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Rows of `keys` (uint64, 1-D) in `table`: float32 (len(keys), dim).
    fn fetch(
        &self,
        py: Python<'_>,
        table: &str,
        keys: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<RowsArray> {
        let planned = self.plan_fetch(table, &keys);
        drop(keys);
        let inner = &self.inner;
        self.block_on(py, async move { inner.fetch_planned(&planned).await })
            .map(RowsArray)
    }

    /// Rows of several tables: `[(table, keys)]` -> `[rows]`.
    fn fetch_many(
        &self,
        py: Python<'_>,
        specs: Vec<(String, PyReadonlyArray1<'_, u64>)>,
    ) -> PyResult<Vec<RowsArray>> {
        let planned = self.plan_fetch_many(&specs);
        drop(specs);
        let inner = &self.inner;
        self.block_on(py, async move { fetch_all(inner, &planned).await })
    }

    /// Applies `gradients` (float32 (len(keys), dim)) to `table`'s rows of
    /// `keys`, under `push_id` (a failed Push's id to retry it) or a fresh
    /// id; returns the id.
    #[pyo3(signature = (table, keys, gradients, push_id = None))]
    fn push(
        &self,
        py: Python<'_>,
        table: String,
        keys: PyReadonlyArray1<'_, u64>,
        gradients: PyReadonlyArray2<'_, f32>,
        push_id: Option<u64>,
    ) -> PyResult<u64> {
        self.push_many(py, vec![(table, keys, gradients)], push_id)
    }

    /// One Push of several tables: `[(table, keys, gradients)]`.
    #[pyo3(signature = (specs, push_id = None))]
    fn push_many(
        &self,
        py: Python<'_>,
        specs: Vec<(String, PyReadonlyArray1<'_, u64>, PyReadonlyArray2<'_, f32>)>,
        push_id: Option<u64>,
    ) -> PyResult<u64> {
        let planned = self.plan_push(py, &specs)?;
        drop(specs);
        let id = self.push_id(push_id);
        let inner = &self.inner;
        self.block_on(py, async move { inner.push_planned(id, &planned).await })?;
        Ok(id.sequence())
    }

    /// Every server's health: `[(address, dict | None, error | None)]`.
    fn health(&self, py: Python<'_>) -> PyResult<Vec<(String, Py<PyAny>)>> {
        let inner = &self.inner;
        let answers = self.block_on(
            py,
            async move { Ok::<_, WorkerError>(inner.health().await) },
        )?;
        answers
            .into_iter()
            .map(|(addr, answer)| Ok((addr, health_to_py(py, answer)?)))
            .collect()
    }

    /// `fetch` as an awaitable.
    fn fetch_async<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        keys: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let planned = self.plan_fetch(table, &keys);
        drop(keys);
        let inner = Arc::clone(&self.inner);
        self.future(py, async move {
            inner.fetch_planned(&planned).await.map(RowsArray)
        })
    }

    /// `fetch_many` as an awaitable.
    fn fetch_many_async<'py>(
        &self,
        py: Python<'py>,
        specs: Vec<(String, PyReadonlyArray1<'_, u64>)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let planned = self.plan_fetch_many(&specs);
        drop(specs);
        let inner = Arc::clone(&self.inner);
        self.future(py, async move { fetch_all(&inner, &planned).await })
    }

    /// `push_many` as an awaitable (resolves to the Push's id).
    #[pyo3(signature = (specs, push_id = None))]
    fn push_many_async<'py>(
        &self,
        py: Python<'py>,
        specs: Vec<(String, PyReadonlyArray1<'_, u64>, PyReadonlyArray2<'_, f32>)>,
        push_id: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let planned = self.plan_push(py, &specs)?;
        drop(specs);
        let id = self.push_id(push_id);
        let inner = Arc::clone(&self.inner);
        self.future(py, async move {
            inner
                .push_planned(id, &planned)
                .await
                .map(|()| id.sequence())
        })
    }
}

impl Client {
    fn plan_fetch_many(&self, specs: &[(String, PyReadonlyArray1<'_, u64>)]) -> Vec<PlannedFetch> {
        specs
            .iter()
            .map(|(table, keys)| self.plan_fetch(table, keys))
            .collect()
    }
}

/// Every planned Fetch at once (as [`PsClient::fetch_many`]).
async fn fetch_all(
    client: &PsClient,
    planned: &[PlannedFetch],
) -> Result<Vec<RowsArray>, WorkerError> {
    let rows =
        futures::future::try_join_all(planned.iter().map(|p| client.fetch_planned(p))).await?;
    Ok(rows.into_iter().map(RowsArray).collect())
}

/// One server's health answer as a dict, or its error as an exception.
fn health_to_py(py: Python<'_>, answer: Result<HealthResponse, RpcError>) -> PyResult<Py<PyAny>> {
    let health = match answer {
        Ok(health) => health,
        Err(err) => {
            let code = err.code();
            return Ok(errors::status_error(py, code, err.to_string())
                .into_value(py)
                .into_any());
        }
    };
    let dict = PyDict::new(py);
    dict.set_item("serving", health.serving)?;
    dict.set_item("state", health.state().as_str_name())?;
    dict.set_item("num_shards", health.num_shards)?;
    dict.set_item("shards", health.shards.clone())?;
    dict.set_item("primary_shards", health.primary_shards.clone())?;
    dict.set_item("replica_group", health.replica_group)?;
    dict.set_item("transport", health.transport.clone())?;
    let tables = PyDict::new(py);
    for table in &health.tables {
        let info = PyDict::new(py);
        info.set_item("dim", table.dim)?;
        info.set_item("rows", table.rows)?;
        tables.set_item(&table.name, info)?;
    }
    dict.set_item("tables", tables)?;
    Ok(dict.into_any().unbind())
}
