//! The sampler against hand-computed cases and the distributions it must draw from.

use webgpu_llm::sampling::{argmax, Rng, Sampler, SamplingParams, Tail, TAIL_REL_ERROR};
use webgpu_llm::Error;

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, seed, ..SamplingParams::greedy() }
}

/// Logits of a fixed pseudo-random spread over `n` tokens.
fn spread_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_f64() * 12.0 - 6.0) as f32).collect()
}

#[test]
fn rng_follows_the_published_xoshiro256_starstar() {
    // From an independent Python implementation of splitmix64 seeding + xoshiro256** (whose
    // splitmix64(0) first output, 0xe220a8397b1dcdaf, is the published test vector).
    let mut rng = Rng::new(42);
    assert_eq!(
        [rng.next_u64(), rng.next_u64(), rng.next_u64()],
        [0x15780b2e0c2ec716, 0x6104d9866d113a7e, 0xae17533239e499a1]
    );
}

#[test]
fn temperature_zero_and_top_k_one_are_greedy() {
    for seed in 0..20 {
        let logits = spread_logits(1000, seed);
        let want = argmax(&logits);
        let mut greedy = Sampler::new(params(0.0, 0, 1.0, 0.0, seed), 1000).unwrap();
        assert_eq!(greedy.sample(&mut logits.clone()), want);
        let mut top1 = Sampler::new(params(1.5, 1, 0.9, 0.0, seed), 1000).unwrap();
        assert_eq!(top1.sample(&mut logits.clone()), want);
    }
}

#[test]
fn top_p_keeps_the_smallest_set_whose_mass_reaches_p() {
    // Probabilities 0.5, 0.25, 0.15, 0.1 (in shuffled order): with p = 0.7 the two most likely
    // tokens (mass 0.75) are kept; 0.5 alone is not enough. With p = 0.8 the third joins (0.9).
    let probs = [0.15f64, 0.5, 0.1, 0.25];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
    for (top_p, kept) in [(0.7, vec![1, 3]), (0.8, vec![1, 3, 0]), (0.4, vec![1]), (1.0, vec![1, 3, 0, 2])] {
        let mut s = Sampler::new(params(1.0, 0, top_p, 0.0, 7), 4).unwrap();
        let cands = s.top_candidates(&logits, 4);
        let got: Vec<u32> = cands.iter().filter(|c| c.kept).map(|c| c.id).collect();
        assert_eq!(got, kept, "top_p {top_p}");
        assert!((cands[0].prob as f64 - 0.5).abs() < 1e-6);
        for _ in 0..500 {
            assert!(kept.contains(&s.sample(&mut logits.clone())), "top_p {top_p} drew a dropped token");
        }
    }
}

#[test]
fn min_p_drops_tokens_below_a_fraction_of_the_best() {
    let probs = [0.5f64, 0.3, 0.12, 0.08];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
    // 0.2 * 0.5 = 0.1: 0.08 goes, 0.12 stays.
    let mut s = Sampler::new(params(1.0, 0, 1.0, 0.2, 1), 4).unwrap();
    let kept: Vec<u32> = s.top_candidates(&logits, 4).iter().filter(|c| c.kept).map(|c| c.id).collect();
    assert_eq!(kept, [0, 1, 2]);
}

/// Draws `n` samples and checks each token's frequency against `expected` within 5 standard
/// errors (|f - p| <= 5 sqrt(p(1-p)/n)); tokens with p = 0 must never be drawn.
fn check_frequencies(p: SamplingParams, logits: &[f32], expected: &[f64], n: usize) {
    let mut s = Sampler::new(p, logits.len()).unwrap();
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[s.sample(&mut logits.to_vec()) as usize] += 1;
    }
    for (i, (&c, &want)) in counts.iter().zip(expected).enumerate() {
        let f = c as f64 / n as f64;
        let bound = 5.0 * (want * (1.0 - want) / n as f64).sqrt();
        assert!((f - want).abs() <= bound.max(0.0), "token {i}: frequency {f}, expected {want} ± {bound}");
    }
}

fn softmax64(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[test]
fn draws_follow_the_tempered_distribution() {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5, 0.0];
    let t = 0.8;
    let expected = softmax64(&logits.iter().map(|&l| l as f64 / t).collect::<Vec<_>>());
    check_frequencies(params(t as f32, 0, 1.0, 0.0, 123), &logits, &expected, 20_000);
}

#[test]
fn draws_follow_the_renormalized_top_k_distribution() {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5, 0.0];
    // Top-3: ids 1, 4, 0; the rest have probability 0.
    let kept = softmax64(&[2.0, 1.5, 1.0]);
    let expected = [kept[2], kept[0], 0.0, 0.0, kept[1], 0.0];
    check_frequencies(params(1.0, 3, 1.0, 0.0, 9), &logits, &expected, 20_000);
}

#[test]
fn the_same_seed_gives_the_same_tokens() {
    let logits = spread_logits(500, 3);
    let run = |seed| {
        let mut s = Sampler::new(params(1.0, 50, 0.95, 0.0, seed), 500).unwrap();
        (0..200).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let mut p = SamplingParams::greedy();
    p.repetition_penalty = 5.0;
    let mut s = Sampler::new(p, 3).unwrap();
    s.accept(0);
    s.accept(1);
    let mut logits = [2.0, -1.0, 0.5];
    assert_eq!(s.sample(&mut logits), 2);
    assert_eq!(logits, [0.4, -5.0, 0.5]);
}

#[test]
fn presence_and_frequency_penalties_subtract_per_token_and_per_occurrence() {
    let mut p = SamplingParams::greedy();
    p.presence_penalty = 0.05;
    p.frequency_penalty = 0.1;
    let mut s = Sampler::new(p, 2).unwrap();
    s.accept(0);
    s.accept(0);
    let mut logits = [1.0f32, 0.9];
    assert_eq!(s.sample(&mut logits), 1);
    assert!((logits[0] - 0.75).abs() < 1e-6 && logits[1] == 0.9);
}

#[test]
fn invalid_parameters_are_named() {
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("temperature", SamplingParams { temperature: -0.1, ..Default::default() }),
        ("temperature", SamplingParams { temperature: f32::NAN, ..Default::default() }),
        ("top_p", SamplingParams { top_p: 0.0, ..Default::default() }),
        ("top_p", SamplingParams { top_p: 1.5, ..Default::default() }),
        ("min_p", SamplingParams { min_p: 1.0, ..Default::default() }),
        ("min_p", SamplingParams { min_p: -0.1, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..Default::default() }),
        // A penalty that divides a logit of 100 past f32's range, and one that explodes them.
        ("repetition_penalty", SamplingParams { repetition_penalty: 1e-38, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: 1e30, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::NAN, ..Default::default() }),
        ("presence_penalty", SamplingParams { presence_penalty: 3.0, ..Default::default() }),
        ("frequency_penalty", SamplingParams { frequency_penalty: f32::INFINITY, ..Default::default() }),
    ];
    for (name, p) in cases {
        match Sampler::new(p, 10) {
            Err(Error::InvalidSamplingParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("expected an error naming {name}, got {:?}", other.err()),
        }
    }
}

#[test]
fn a_temperature_so_small_that_logits_overflow_samples_the_argmax() {
    // Logits / 1e-38 overflow f32: without care every value is +-inf and the softmax NaN (the
    // sampler then picked token 0 forever). All the mass is on the largest logit: greedy.
    let logits = vec![-3.0f32, 12.5, 40.0, 39.9, -100.0, 0.0];
    for seed in 0..20 {
        let params =
            SamplingParams { temperature: 1e-38, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..Default::default() };
        let mut sampler = Sampler::new(params, logits.len()).unwrap();
        assert_eq!(sampler.sample(&mut logits.clone()), 2);
        let shown = sampler.top_candidates(&logits, 3);
        assert_eq!((shown[0].id, shown[0].prob, shown[0].kept), (2, 1.0, true));
        assert!(shown[1..].iter().all(|c| c.prob == 0.0 && !c.kept), "{shown:?}");
    }
    // A small temperature that does not overflow still samples: 0.5 between two close logits.
    let params = SamplingParams { temperature: 0.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() };
    let mut sampler = Sampler::new(params, 2).unwrap();
    let ids: std::collections::HashSet<u32> = (0..200).map(|_| sampler.sample(&mut [1.0, 1.1])).collect();
    assert_eq!(ids.len(), 2);
}

/// What the GPU hands a top-k sampler: the k largest logits in no particular order.
fn largest(logits: &[f32], k: usize, rng: &mut Rng) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    // Shuffled: the selection comes back in no order.
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    all
}

#[test]
fn sampling_from_the_k_largest_logits_gives_the_same_tokens_as_from_all_of_them() {
    let mut shuffle = Rng::new(99);
    for (temperature, top_k, top_p, min_p) in
        [(0.7, 40, 0.9, 0.05), (1.0, 2, 1.0, 0.0), (1.5, 200, 1.0, 0.0), (0.3, 1000, 0.5, 0.1), (1e-38, 40, 0.9, 0.0)]
    {
        for seed in 0..20 {
            let logits = spread_logits(5000, seed);
            let p = params(temperature, top_k, top_p, min_p, seed);
            let (mut all, mut top) = (Sampler::new(p.clone(), 5000).unwrap(), Sampler::new(p, 5000).unwrap());
            assert_eq!(top.top_k_only(), Some(top_k));
            let k = largest(&logits, top_k, &mut shuffle);
            for draw in 0..50 {
                let want = all.sample(&mut logits.clone());
                assert_eq!(
                    top.sample_top_k(&k),
                    want,
                    "temperature {temperature}, top-k {top_k}, seed {seed}, draw {draw}"
                );
            }
        }
    }
    // Penalties or no top-k: the sampler needs every logit; top-k 1 is greedy (the argmax).
    assert_eq!(Sampler::new(params(0.7, 1, 0.9, 0.0, 1), 10).unwrap().top_k_only(), None);
    assert_eq!(Sampler::new(params(0.7, 0, 0.9, 0.0, 1), 10).unwrap().top_k_only(), None);
    let penalized = SamplingParams { repetition_penalty: 1.1, ..params(0.7, 40, 0.9, 0.0, 1) };
    assert_eq!(Sampler::new(penalized, 10).unwrap().top_k_only(), None);
    assert_eq!(Sampler::new(SamplingParams::greedy(), 10).unwrap().top_k_only(), None);
}

/// Logits falling off as -s ln(rank) (a language model's usual shape), ids shuffled.
fn zipf_logits(n: usize, s: f64, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut logits: Vec<f32> = (0..n).map(|r| (-s * ((r + 1) as f64).ln() + rng.next_f64() * 0.1) as f32).collect();
    for i in (1..n).rev() {
        logits.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    logits
}

/// What the GPU reports of the logits outside the k largest: their weights' sum (computed here in
/// f64 from its definition, then put off by up to half the error the sampler allows, as the
/// GPU's f32 exp and sums are) and the largest |logit|.
fn tail_of(logits: &[f32], k: usize, temperature: f32, rng: &mut Rng) -> Tail {
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let max = sorted[0] as f64 / temperature as f64;
    let exact: f64 = sorted[k.min(sorted.len())..].iter().map(|&l| (l as f64 / temperature as f64 - max).exp()).sum();
    let off = (rng.next_f64() * 2.0 - 1.0) * 0.5 * TAIL_REL_ERROR;
    Tail { sum: (exact * (1.0 + off)) as f32, max_abs: logits.iter().fold(0f32, |m, l| m.max(l.abs())) }
}

#[test]
fn top_p_and_min_p_sampling_from_the_largest_logits_and_the_tail_gives_the_same_tokens_as_from_all() {
    let mut rng = Rng::new(5);
    let (n, k) = (5000, 256);
    // (logits, temperature, top-p, min-p, the least share of draws told from the k largest).
    let cases: Vec<(Vec<f32>, f32, f32, f32, f64)> = vec![
        (zipf_logits(n, 2.0, 1), 0.7, 0.9, 0.0, 0.9),
        (zipf_logits(n, 1.5, 2), 1.0, 0.95, 0.0, 0.8),
        (zipf_logits(n, 2.0, 3), 0.8, 1.0, 0.05, 0.9),
        (zipf_logits(n, 1.2, 4), 1.0, 0.5, 0.1, 0.8),
        (zipf_logits(n, 3.0, 5), 1e-38, 0.9, 0.0, 1.0),
        // Flat: the nucleus reaches past the k largest, so every draw needs all the logits.
        (spread_logits(n, 6), 1.0, 0.99, 0.0, 0.0),
        (spread_logits(n, 7), 1.0, 1.0, 0.001, 0.0),
    ];
    for (logits, temperature, top_p, min_p, least) in cases {
        let p = params(temperature, 0, top_p, min_p, 9);
        let (mut all, mut top) = (Sampler::new(p.clone(), n).unwrap(), Sampler::new(p, n).unwrap());
        assert!(top.nucleus_only());
        let mut shuffle = Rng::new(3);
        let (mut told, draws) = (0, 400);
        for draw in 0..draws {
            let want = all.sample(&mut logits.clone());
            let largest = largest(&logits, k, &mut shuffle);
            let got = match top.sample_nucleus(&largest, n, tail_of(&logits, k, temperature, &mut rng)) {
                Some(id) => {
                    told += 1;
                    id
                }
                // The engine's fallback: every logit read back.
                None => top.sample(&mut logits.clone()),
            };
            assert_eq!(got, want, "temperature {temperature}, top-p {top_p}, min-p {min_p}, draw {draw}");
        }
        let share = told as f64 / draws as f64;
        assert!(
            share >= least,
            "temperature {temperature}, top-p {top_p}, min-p {min_p}: {share} told from the largest"
        );
        if least == 0.0 {
            assert_eq!(told, 0, "a nucleus past the k largest is never cut from them alone");
        }
    }
    // Top-k set, penalties or neither cut: not a nucleus sampler.
    assert!(!Sampler::new(params(0.7, 40, 0.9, 0.0, 1), 10).unwrap().nucleus_only());
    assert!(!Sampler::new(params(0.7, 0, 1.0, 0.0, 1), 10).unwrap().nucleus_only());
    let penalized = SamplingParams { presence_penalty: 0.5, ..params(0.7, 0, 0.9, 0.0, 1) };
    assert!(!Sampler::new(penalized, 10).unwrap().nucleus_only());
}
