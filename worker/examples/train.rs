//! A training loop on the worker client: fetch a batch's rows, compute a
//! gradient, push it. A Push that fails part-way is retried under its id,
//! so every shard applies it exactly once.
//!
//! `cargo run -p tessera-worker --example train -- run/worker.toml [STEPS]`
#![allow(clippy::print_stdout)] // an example prints what it did

use std::path::PathBuf;

use tessera_worker::{PsClient, WorkerConfig, WorkerError};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let config_path = args
        .next()
        .map_or_else(|| PathBuf::from("run/worker.toml"), PathBuf::from);
    let steps: u64 = match args.next() {
        Some(steps) => steps.to_string_lossy().parse()?,
        None => 100,
    };
    let config = WorkerConfig::load(&config_path)?;
    let client = PsClient::new(&config)?;
    let table = "embeddings";

    for step in 0..steps {
        // A batch of 64 feature ids (repeats are fine: the client sums them).
        let keys: Vec<u64> = (0..64).map(|i| (step * 31 + i * 977) % 100_000).collect();
        let rows = client.fetch(table, &keys).await?;
        // The gradient of 0.5 * (value - 0.1)^2: pulls every value to 0.1.
        let gradients: Vec<f32> = rows.values().iter().map(|v| v - 0.1).collect();

        let id = client.next_push_id();
        let mut attempts = 0;
        loop {
            attempts += 1;
            match client
                .push_as(id, table, &keys, &gradients, rows.dim())
                .await
            {
                Ok(()) => break,
                // Some shards applied it and some did not: the same id and
                // arguments apply it where it is missing, and only there.
                Err(WorkerError::Push(failure)) if failure.retriable() && attempts < 3 => {}
                Err(error) => return Err(error.into()),
            }
        }
    }

    let rows = client.fetch(table, &[0, 977]).await?;
    println!(
        "{steps} steps; row 0 starts {:?}",
        &rows.row(0)[..4.min(rows.dim())]
    );
    Ok(())
}
