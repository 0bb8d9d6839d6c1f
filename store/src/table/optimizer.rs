//! Optimizers applied to a row by a Push: SGD, Adagrad and Adam, with
//! their per-row state.
//!
//! Each row carries `slots() * dim` f32 of state (Adagrad's accumulator;
//! Adam's first and second moments) and, for Adam, its own step count:
//! embedding rows are updated sparsely, so bias correction counts the
//! updates of *this* row (the "lazy" Adam of TensorFlow's embedding
//! optimizers), not global steps it never saw.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, invalid};

/// A table's optimizer and its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `w -= learning_rate * g`.
    Sgd {
        /// Step size. Default 0.01, a common start for embedding tables.
        #[serde(default = "sgd_learning_rate")]
        learning_rate: f32,
    },
    /// `acc += g²; w -= learning_rate * g / (sqrt(acc) + epsilon)`.
    Adagrad {
        /// Step size. Default 0.01.
        #[serde(default = "sgd_learning_rate")]
        learning_rate: f32,
        /// Accumulator of a new row. Default 0.1 (TensorFlow's): keeps the
        /// first steps of a new row from being huge.
        #[serde(default = "adagrad_initial_accumulator")]
        initial_accumulator: f32,
        /// Added to the denominator. Default 1e-7 (TensorFlow's).
        #[serde(default = "adagrad_epsilon")]
        epsilon: f32,
    },
    /// Adam with per-row bias correction (module docs).
    Adam {
        /// Step size. Default 0.001 (Kingma and Ba).
        #[serde(default = "adam_learning_rate")]
        learning_rate: f32,
        /// Decay of the first moment. Default 0.9.
        #[serde(default = "adam_beta1")]
        beta1: f32,
        /// Decay of the second moment. Default 0.999.
        #[serde(default = "adam_beta2")]
        beta2: f32,
        /// Added to the denominator. Default 1e-8.
        #[serde(default = "adam_epsilon")]
        epsilon: f32,
    },
}

fn sgd_learning_rate() -> f32 {
    0.01
}
fn adagrad_initial_accumulator() -> f32 {
    0.1
}
fn adagrad_epsilon() -> f32 {
    1e-7
}
fn adam_learning_rate() -> f32 {
    0.001
}
fn adam_beta1() -> f32 {
    0.9
}
fn adam_beta2() -> f32 {
    0.999
}
fn adam_epsilon() -> f32 {
    1e-8
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Sgd {
            learning_rate: sgd_learning_rate(),
        }
    }
}

impl OptimizerConfig {
    /// SGD with `learning_rate`.
    pub fn sgd(learning_rate: f32) -> Self {
        OptimizerConfig::Sgd { learning_rate }
    }

    /// Adagrad with `learning_rate` and the other defaults.
    pub fn adagrad(learning_rate: f32) -> Self {
        OptimizerConfig::Adagrad {
            learning_rate,
            initial_accumulator: adagrad_initial_accumulator(),
            epsilon: adagrad_epsilon(),
        }
    }

    /// Adam with `learning_rate` and the other defaults.
    pub fn adam(learning_rate: f32) -> Self {
        OptimizerConfig::Adam {
            learning_rate,
            beta1: adam_beta1(),
            beta2: adam_beta2(),
            epsilon: adam_epsilon(),
        }
    }

    /// The name in configuration files.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd { .. } => "sgd",
            OptimizerConfig::Adagrad { .. } => "adagrad",
            OptimizerConfig::Adam { .. } => "adam",
        }
    }

    /// State values per row value.
    pub fn slots(&self) -> usize {
        match self {
            OptimizerConfig::Sgd { .. } => 0,
            OptimizerConfig::Adagrad { .. } => 1,
            OptimizerConfig::Adam { .. } => 2,
        }
    }

    /// The state of a new row of `dim` values.
    pub fn initial_state(&self, dim: usize) -> Box<[f32]> {
        let mut out = vec![0.0; self.slots() * dim].into_boxed_slice();
        self.fill_initial_state(&mut out);
        out
    }

    /// Writes the state of a new row into `out`.
    pub fn fill_initial_state(&self, out: &mut [f32]) {
        match self {
            OptimizerConfig::Adagrad {
                initial_accumulator,
                ..
            } => out.fill(*initial_accumulator),
            _ => out.fill(0.0),
        }
    }

    /// Whether [`OptimizerConfig::apply`] reads the row's step count
    /// (Adam's bias correction).
    pub fn uses_steps(&self) -> bool {
        matches!(self, OptimizerConfig::Adam { .. })
    }

    /// Checks the parameters; `key` names the table's optimizer in errors.
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let positive = |name: &str, value: f32| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(invalid(
                    format!("{key}.{name}"),
                    format!("{value} must be a positive number"),
                ))
            }
        };
        let unit = |name: &str, value: f32| {
            if (0.0..1.0).contains(&value) {
                Ok(())
            } else {
                Err(invalid(
                    format!("{key}.{name}"),
                    format!("{value} must be in [0, 1)"),
                ))
            }
        };
        match *self {
            OptimizerConfig::Sgd { learning_rate } => positive("learning_rate", learning_rate),
            OptimizerConfig::Adagrad {
                learning_rate,
                initial_accumulator,
                epsilon,
            } => {
                positive("learning_rate", learning_rate)?;
                positive("initial_accumulator", initial_accumulator)?;
                positive("epsilon", epsilon)
            }
            OptimizerConfig::Adam {
                learning_rate,
                beta1,
                beta2,
                epsilon,
            } => {
                positive("learning_rate", learning_rate)?;
                unit("beta1", beta1)?;
                unit("beta2", beta2)?;
                positive("epsilon", epsilon)
            }
        }
    }

    /// Applies `grad` to `values` (one row), updating the row's `state`
    /// (`slots() * values.len()` values) and `steps` (updates so far).
    pub fn apply(&self, values: &mut [f32], state: &mut [f32], steps: &mut u32, grad: &[f32]) {
        *steps = steps.saturating_add(1);
        match *self {
            OptimizerConfig::Sgd { learning_rate } => {
                for (w, g) in values.iter_mut().zip(grad) {
                    *w -= learning_rate * g;
                }
            }
            OptimizerConfig::Adagrad {
                learning_rate,
                epsilon,
                ..
            } => {
                for ((w, acc), g) in values.iter_mut().zip(state.iter_mut()).zip(grad) {
                    *acc += g * g;
                    *w -= learning_rate * g / (acc.sqrt() + epsilon);
                }
            }
            OptimizerConfig::Adam {
                learning_rate,
                beta1,
                beta2,
                epsilon,
            } => {
                let dim = values.len();
                let (m, v) = state.split_at_mut(dim);
                // The exponent saturates at i32::MAX: by then beta^t is 0
                // in f32 for every beta < 1 (the largest, 1 - 2^-24, gives
                // e^-128), so the corrections are exactly 1.0, as they
                // have been for many steps. (`as i32` would wrap to a
                // negative exponent after 2^31 updates: an infinite
                // correction freezes the row, then NaN.)
                let t = i32::try_from(*steps).unwrap_or(i32::MAX);
                let correction1 = 1.0 - beta1.powi(t);
                let correction2 = 1.0 - beta2.powi(t);
                for (((w, m), v), g) in values.iter_mut().zip(m).zip(v).zip(grad) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let m_hat = *m / correction1;
                    let v_hat = *v / correction2;
                    *w -= learning_rate * m_hat / (v_hat.sqrt() + epsilon);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) {
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} != {b}");
    }

    fn run(optimizer: OptimizerConfig, start: &[f32], grads: &[&[f32]]) -> (Vec<f32>, Vec<f32>) {
        let mut values = start.to_vec();
        let mut state = optimizer.initial_state(start.len()).into_vec();
        let mut steps = 0;
        for grad in grads {
            optimizer.apply(&mut values, &mut state, &mut steps, grad);
        }
        assert_eq!(steps as usize, grads.len());
        (values, state)
    }

    #[test]
    fn sgd_matches_hand_computation() {
        let (values, state) = run(
            OptimizerConfig::sgd(0.5),
            &[1.0, -2.0],
            &[&[0.2, -4.0], &[1.0, 0.0]],
        );
        // 1 - 0.5*0.2 - 0.5*1 = 0.4; -2 + 0.5*4 - 0 = 0
        close(values[0], 0.4);
        close(values[1], 0.0);
        assert!(state.is_empty());
    }

    #[test]
    fn adagrad_matches_hand_computation() {
        let optimizer = OptimizerConfig::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-7,
        };
        let (values, state) = run(optimizer, &[1.0], &[&[2.0], &[-1.0]]);
        // step 1: acc = 0.1 + 4 = 4.1; w = 1 - 0.1*2/(sqrt(4.1)+1e-7)
        let acc1 = 4.1f32;
        let w1 = 1.0 - 0.1 * 2.0 / (acc1.sqrt() + 1e-7);
        // step 2: acc = 4.1 + 1 = 5.1; w = w1 + 0.1*1/(sqrt(5.1)+1e-7)
        let acc2 = 5.1f32;
        let w2 = w1 + 0.1 / (acc2.sqrt() + 1e-7);
        close(state[0], acc2);
        close(values[0], w2);
        // Known decimals: 1 - 0.2/2.0248457 = 0.9012270; + 0.1/2.2583180 = 0.9455080
        close(values[0], 0.945_508);
    }

    #[test]
    fn adam_matches_hand_computation_with_per_row_bias_correction() {
        let optimizer = OptimizerConfig::Adam {
            learning_rate: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
        };
        let (values, state) = run(optimizer, &[0.5], &[&[1.0], &[-2.0]]);
        // t=1: m = 0.1, v = 0.001, m^ = 1, v^ = 1 -> w = 0.5 - 0.01 = 0.49
        // t=2: m = 0.09 - 0.2 = -0.11, v = 0.000999 + 0.004 = 0.004999
        //      m^ = -0.11/0.19 = -0.5789474, v^ = 0.004999/0.001999 = 2.5007504
        //      w = 0.49 + 0.01 * 0.5789474 / 1.5813761 = 0.4936610
        close(state[0], -0.11);
        close(state[1], 0.004_999);
        close(values[0], 0.493_661);
    }

    /// A row updated more than 2^31 times (a key in every Push, at 10k
    /// Pushes/s for 2.5 days) keeps training: its corrections are 1.0.
    #[test]
    fn adam_keeps_training_rows_past_two_to_the_31_steps() {
        let optimizer = OptimizerConfig::Adam {
            learning_rate: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
        };
        for start in [
            1_000_000,
            i32::MAX as u32 - 1,
            i32::MAX as u32,
            u32::MAX - 1,
            u32::MAX,
        ] {
            let mut values = [0.5f32];
            let mut state = [0.1f32, 0.01];
            let mut steps = start;
            optimizer.apply(&mut values, &mut state, &mut steps, &[1.0]);
            // m = 0.09 + 0.1 = 0.19, v = 0.00999 + 0.001 = 0.01099, no
            // bias correction left: w = 0.5 - 0.01 * 0.19 / sqrt(0.01099).
            close(state[0], 0.19);
            close(state[1], 0.010_99);
            let expected = 0.5 - 0.01 * 0.19 / (0.010_99f32.sqrt() + 1e-8);
            close(values[0], expected);
            assert!(values[0].is_finite() && values[0] < 0.5, "after {start}");
        }
    }

    #[test]
    fn parameters_are_validated_with_their_key() {
        let bad = OptimizerConfig::Adam {
            learning_rate: 0.01,
            beta1: 1.0,
            beta2: 0.999,
            epsilon: 1e-8,
        };
        let err = bad.validate("tables[2].optimizer").unwrap_err().to_string();
        assert!(err.contains("tables[2].optimizer.beta1"), "{err}");
        let err = OptimizerConfig::sgd(f32::NAN)
            .validate("tables[0].optimizer")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tables[0].optimizer.learning_rate"), "{err}");
        OptimizerConfig::adagrad(0.1).validate("x").unwrap();
    }

    #[test]
    fn toml_names_the_kind_and_fills_defaults() {
        #[derive(Deserialize)]
        struct Wrapper {
            optimizer: OptimizerConfig,
        }
        let w: Wrapper =
            toml::from_str("optimizer = { kind = \"adam\", learning_rate = 0.002 }").unwrap();
        assert_eq!(
            w.optimizer,
            OptimizerConfig::Adam {
                learning_rate: 0.002,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-8
            }
        );
        assert!(toml::from_str::<Wrapper>("optimizer = { kind = \"rmsprop\" }").is_err());
    }
}
