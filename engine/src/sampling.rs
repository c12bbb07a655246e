//! Next-token sampling from logits: greedy, or temperature with top-k and top-p, seeded.
//!
//! Order as in llama.cpp's default chain: top-k, then top-p on the softmax of the raw logits,
//! then temperature on what is left, then one draw. Temperature 0 is greedy (argmax).

use memra_reference::Rng;

use crate::tokenizer::TokenId;

/// Sampling settings. `top_k = 0` and `top_p = 1` switch those filters off.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Rejects values that have no meaning (negative or NaN temperature, top-p outside (0, 1]).
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature {} must be a finite number ≥ 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} must be in (0, 1]", self.top_p));
        }
        Ok(())
    }
}

/// A seeded sampler: the same config and logits give the same tokens.
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Self, String> {
        config.validate()?;
        Ok(Sampler {
            config,
            rng: Rng::new(config.seed),
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Picks the next token. NaN logits are never chosen.
    ///
    /// # Panics
    /// If `logits` is empty or all NaN.
    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        let c = self.config;
        if c.temperature == 0.0 || c.top_k == 1 {
            return argmax(logits);
        }
        let candidates = top_p(top_k(logits, c.top_k), c.top_p);
        // Temperature on the kept candidates; softmax in f64 relative to the best logit.
        let best = candidates[0].1 as f64;
        let weights: Vec<f64> = candidates
            .iter()
            .map(|&(_, l)| ((l as f64 - best) / c.temperature as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut u = self.rng.uniform_f64() * total;
        for (&(id, _), w) in candidates.iter().zip(&weights) {
            if u < *w {
                return id;
            }
            u -= w;
        }
        candidates[candidates.len() - 1].0
    }
}

/// Index of the largest logit (the first one on ties), ignoring NaN.
///
/// # Panics
/// If `logits` is empty or all NaN.
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_nan() && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.expect("argmax: logits are empty or all NaN").0 as TokenId
}

/// The `k` largest logits (all if `k` is 0 or ≥ the count), sorted descending (ties by id).
/// NaN logits are dropped.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    let mut c: Vec<(TokenId, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as TokenId, l))
        .collect();
    assert!(!c.is_empty(), "top_k: logits are empty or all NaN");
    let order = |a: &(TokenId, f32), b: &(TokenId, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k > 0 && k < c.len() {
        c.select_nth_unstable_by(k - 1, order);
        c.truncate(k);
    }
    c.sort_unstable_by(order);
    c
}

/// Nucleus filter on candidates sorted descending: keeps the smallest prefix whose softmax
/// mass (over the candidates given) is ≥ `p`; at least one.
pub fn top_p(candidates: Vec<(TokenId, f32)>, p: f32) -> Vec<(TokenId, f32)> {
    if p >= 1.0 || candidates.len() <= 1 {
        return candidates;
    }
    let best = candidates[0].1 as f64;
    let weights: Vec<f64> = candidates
        .iter()
        .map(|&(_, l)| (l as f64 - best).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut mass = 0.0;
    let mut keep = candidates.len();
    for (i, w) in weights.iter().enumerate() {
        mass += w / total;
        if mass >= p as f64 {
            keep = i + 1;
            break;
        }
    }
    let mut candidates = candidates;
    candidates.truncate(keep);
    candidates
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_logits(rng: &mut Rng, n: usize) -> Vec<f32> {
        rng.normal_vec(n, 3.0)
    }

    #[test]
    fn greedy_is_argmax() {
        let mut rng = Rng::from_env_or_time("greedy_is_argmax");
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        for _ in 0..50 {
            let logits = random_logits(&mut rng, 1000);
            let (want, _) = logits
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &l)| if l > b.1 { (i, l) } else { b });
            assert_eq!(
                sampler.sample(&logits),
                want as TokenId,
                "seed {}",
                rng.seed()
            );
        }
        assert_eq!(
            argmax(&[1.0, f32::NAN, 3.0, 3.0]),
            2,
            "NaN skipped, first max wins"
        );
    }

    #[test]
    fn top_k_1_is_greedy_at_any_temperature() {
        let mut rng = Rng::from_env_or_time("top_k_1_is_greedy");
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: rng.next_u64(),
        })
        .unwrap();
        for _ in 0..50 {
            let logits = random_logits(&mut rng, 500);
            assert_eq!(
                sampler.sample(&logits),
                argmax(&logits),
                "seed {}",
                rng.seed()
            );
        }
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let logits = [0.5, 3.0, -1.0, 2.0, 3.0, 1.0];
        let ids: Vec<TokenId> = top_k(&logits, 3).iter().map(|c| c.0).collect();
        assert_eq!(ids, [1, 4, 3]);
        assert_eq!(top_k(&logits, 0).len(), 6);
    }

    #[test]
    fn top_p_keeps_smallest_prefix_with_enough_mass() {
        // Logits whose softmax is 0.5, 0.3, 0.15, 0.05.
        let probs = [0.5f64, 0.3, 0.15, 0.05];
        let cands: Vec<(TokenId, f32)> = probs
            .iter()
            .enumerate()
            .map(|(i, p)| (i as TokenId, p.ln() as f32))
            .collect();
        let kept = |p: f32| top_p(cands.clone(), p).len();
        assert_eq!(kept(0.3), 1);
        assert_eq!(kept(0.49), 1);
        assert_eq!(kept(0.51), 2);
        assert_eq!(kept(0.79), 2);
        assert_eq!(kept(0.81), 3);
        assert_eq!(kept(0.96), 4);
        assert_eq!(kept(1.0), 4);
    }

    #[test]
    fn top_p_sampling_draws_only_from_the_nucleus() {
        let mut rng = Rng::from_env_or_time("top_p_nucleus");
        let logits: Vec<f32> = [0.5f64, 0.3, 0.15, 0.05]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
            seed: rng.next_u64(),
        })
        .unwrap();
        let mut counts = [0usize; 4];
        let n = 20_000;
        for _ in 0..n {
            counts[sampler.sample(&logits) as usize] += 1;
        }
        assert_eq!(
            counts[2] + counts[3],
            0,
            "outside the nucleus: {counts:?}, seed {}",
            rng.seed()
        );
        // Renormalized nucleus: 0.625 / 0.375. 5 sigma of a binomial over 20000 ≈ 0.017.
        let f0 = counts[0] as f64 / n as f64;
        assert!((f0 - 0.625).abs() < 0.017, "freq {f0}, seed {}", rng.seed());
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let mut rng = Rng::from_env_or_time("temperature_softmax");
        // At temperature 2 these logits give probabilities ∝ exp(l/2).
        let logits = [2.0f32, 0.0, -2.0];
        let w: Vec<f64> = logits.iter().map(|&l| (l as f64 / 2.0).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 2.0,
            top_k: 0,
            top_p: 1.0,
            seed: rng.next_u64(),
        })
        .unwrap();
        let n = 30_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[sampler.sample(&logits) as usize] += 1;
        }
        for i in 0..3 {
            let p = w[i] / total;
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            let f = counts[i] as f64 / n as f64;
            assert!(
                (f - p).abs() < 5.0 * sigma,
                "token {i}: freq {f} vs p {p}, seed {}",
                rng.seed()
            );
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let mut rng = Rng::from_env_or_time("same_seed_same_tokens");
        let seed = rng.next_u64();
        let logits: Vec<Vec<f32>> = (0..64).map(|_| rng.normal_vec(200, 1.0)).collect();
        let config = SamplerConfig {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed,
        };
        let run = |config: SamplerConfig| {
            let mut s = Sampler::new(config).unwrap();
            logits.iter().map(|l| s.sample(l)).collect::<Vec<_>>()
        };
        let a = run(config);
        assert_eq!(a, run(config), "seed {}", rng.seed());
        let b = run(SamplerConfig {
            seed: seed ^ 0x5555,
            ..config
        });
        assert_ne!(
            a,
            b,
            "different seeds gave 64 identical draws; seed {}",
            rng.seed()
        );
    }

    #[test]
    fn bad_configs_are_errors() {
        let ok = SamplerConfig::greedy();
        assert!(
            Sampler::new(SamplerConfig {
                temperature: -1.0,
                ..ok
            })
            .is_err()
        );
        assert!(
            Sampler::new(SamplerConfig {
                temperature: f32::NAN,
                ..ok
            })
            .is_err()
        );
        assert!(Sampler::new(SamplerConfig { top_p: 0.0, ..ok }).is_err());
        assert!(Sampler::new(SamplerConfig { top_p: 1.5, ..ok }).is_err());
    }
}
