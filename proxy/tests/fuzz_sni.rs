//! Mutation fuzzing of the ClientHello reader (`tls::sni::parse`), on stable Rust: cargo-fuzz
//! needs nightly, so this is a time-bounded loop with its own mutator, plus property tests.
//!
//! Seeds are real ClientHellos: made by rustls at test time (TLS 1.3 and 1.2, with and
//! without SNI, ALPN, long names) and captured from OpenSSL clients (`redis-cli --tls --sni`,
//! `openssl s_client`) in `testdata/client_hello_*.bin`.
//!
//! Each mutant is checked against invariants, and differentially against rustls's own
//! server-side hello parser (`rustls::server::Acceptor`): when rustls reads a hello and a
//! server name from the bytes, the reader must find the same name.
//!
//! It runs twice: from a fixed seed (the same inputs on every run) and from a random one.
//! `SHARDGATE_FUZZ_SECONDS` sets each run's time (default 2 s); `SHARDGATE_FUZZ_SEED` replays
//! a random run (the seed is printed at the start and on failure).

use shardgate_harness::fuzz::{Rng, Run};
use std::sync::Arc;
use std::time::Instant;

use proptest::prelude::*;
use rustls::pki_types::ServerName;
use shardgate_proxy::tls::sni::testing::{client_hello, message, records};
use shardgate_proxy::tls::sni::{parse, Parsed};

/// One rustls client set-up: versions, server name, whether to send SNI, ALPN protocols.
type Case = (
    Vec<&'static rustls::SupportedProtocolVersion>,
    &'static str,
    bool,
    Vec<Vec<u8>>,
);

/// ClientHellos as rustls sends them.
fn rustls_hellos() -> Vec<Vec<u8>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut out = vec![];
    let cases: Vec<Case> = vec![
        (vec![&rustls::version::TLS13, &rustls::version::TLS12], "vc-0-1.example.test", true, vec![]),
        (vec![&rustls::version::TLS13], "vc-2.example.test", true, vec![b"resp3".to_vec()]),
        (vec![&rustls::version::TLS12], "vc.example.test", true, vec![]),
        (vec![&rustls::version::TLS13, &rustls::version::TLS12], "vc-0-1.example.test", false, vec![]),
        (
            vec![&rustls::version::TLS13],
            "a-very-long-label-that-goes-on-and-on-for-sixty-three-chars-xyz.and-another-one.example.test",
            true,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        ),
    ];
    for (versions, name, sni, alpn) in &cases {
        let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.enable_sni = *sni;
        config.alpn_protocols = alpn.clone();
        let mut conn = rustls::ClientConnection::new(
            Arc::new(config),
            ServerName::try_from(name.to_string()).unwrap(),
        )
        .unwrap();
        let mut bytes = vec![];
        while conn.wants_write() {
            conn.write_tls(&mut bytes).unwrap();
        }
        out.push(bytes);
    }
    out
}

fn captured_hellos() -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let mut out = vec![];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("client_hello_") && name.ends_with(".bin") {
            out.push(std::fs::read(&path).unwrap());
        }
    }
    assert!(out.len() >= 3, "captures in {}", dir.display());
    out
}

fn seeds() -> Vec<Vec<u8>> {
    let mut all = rustls_hellos();
    all.extend(captured_hellos());
    all.push(client_hello(Some("vc-1-1.example.test"), 500));
    all.push(client_hello(None, 0));
    all
}

/// What rustls's own server-side parser makes of `bytes`: `Some(sni)` if it reads a whole
/// ClientHello.
fn rustls_view(bytes: &[u8]) -> Option<Option<String>> {
    let mut acceptor = rustls::server::Acceptor::default();
    let mut rd = bytes;
    while !rd.is_empty() {
        match acceptor.read_tls(&mut rd) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                return Some(
                    accepted
                        .client_hello()
                        .server_name()
                        .map(|s| s.to_ascii_lowercase()),
                )
            }
            Ok(None) => {}
            Err(_) => return None,
        }
    }
    None
}

/// The invariants every input must keep.
fn check(input: &[u8]) {
    let full = parse(input);
    if let Parsed::Hello { sni, len } = &full {
        assert!(*len <= input.len());
        // Bytes after the hello do not change it.
        let mut longer = input.to_vec();
        longer.extend_from_slice(b"\x17\x03\x03garbage");
        assert_eq!(parse(&longer), full);
        // Every prefix of the hello is incomplete (sampled for long inputs).
        let step = (len / 64).max(1);
        for cut in (0..*len).step_by(step) {
            assert!(
                matches!(parse(&input[..cut]), Parsed::Incomplete { .. }),
                "prefix {cut} of a hello: {:?}",
                parse(&input[..cut])
            );
        }
        // The same message in records of another size reads the same.
        let msg = message(&input[..*len]);
        for size in [1, 7, 300] {
            match parse(&records(&msg, size)) {
                Parsed::Hello { sni: s, .. } => assert_eq!(&s, sni),
                other => panic!("refragmented into {size}: {other:?}"),
            }
        }
    }
    if let Parsed::Incomplete { need: Some(n) } = full {
        assert!(n > input.len(), "need {n} with {} bytes", input.len());
    }
    // Differential: what rustls reads as a hello with a name, the reader reads the same.
    if let Some(theirs) = rustls_view(input) {
        match &full {
            Parsed::Hello { sni, .. } => {
                if let (Some(ours), Some(theirs)) = (sni, &theirs) {
                    assert_eq!(ours.as_str(), theirs.trim_end_matches('.'));
                }
                if theirs.is_some() {
                    assert!(sni.is_some(), "rustls found {theirs:?}, we found none");
                }
            }
            other => panic!("rustls read a hello ({theirs:?}), the reader said {other:?}"),
        }
    }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = input.len();
        match rng.below(11) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                input[i] = rng.next_u64() as u8;
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                input.splice(i..i, bytes);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(32)).min(len);
                input.drain(i..j);
            }
            4 => input.truncate(rng.below(len + 1)),
            5 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(64)).min(len);
                let copy = input[i..j].to_vec();
                let at = rng.below(len + 1);
                input.splice(at..at, copy);
            }
            // Length fields: the record's and the handshake message's.
            6 if len > 9 => {
                let at = [3usize, 4, 6, 7, 8][rng.below(5)];
                input[at] = [0u8, 1, 0x7f, 0x80, 0xff][rng.below(5)];
            }
            // A length field deeper in: find a 2-byte big-endian value and nudge it.
            7 if len > 44 => {
                let i = 43 + rng.below(len - 44);
                let v = u16::from_be_bytes([input[i], input[i + 1]]);
                let nv = match rng.below(3) {
                    0 => v.wrapping_add(1),
                    1 => v.wrapping_sub(1),
                    _ => 0xffff,
                };
                input[i..i + 2].copy_from_slice(&nv.to_be_bytes());
            }
            // Refragment into records.
            8 if len > 5 => {
                let msg = message(input);
                *input = records(&msg, 1 + rng.below(400));
            }
            // Splice with another seed.
            9 => {
                let other = &seeds[rng.below(seeds.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            _ => {
                let other = &seeds[rng.below(seeds.len())];
                *input = other.clone();
            }
        }
    }
}

#[test]
fn seeds_are_read_as_rustls_reads_them() {
    let seeds = seeds();
    for (i, s) in seeds.iter().enumerate() {
        check(s);
        assert!(
            matches!(parse(s), Parsed::Hello { .. }),
            "seed {i}: {:?}",
            parse(s)
        );
    }
    // The SNI of each capture.
    let names: Vec<Option<String>> = rustls_hellos()
        .iter()
        .map(|h| match parse(h) {
            Parsed::Hello { sni, .. } => sni.map(|s| s.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(names[0].as_deref(), Some("vc-0-1.example.test"));
    assert_eq!(names[3], None, "enable_sni = false sends no name");
}

/// The same inputs on every run (as many as the time allows): a failure is reproducible as
/// it stands.
#[test]
fn mutation_fuzz_from_a_fixed_seed() {
    let run = Run::from_env(2);
    mutation_fuzz(Run {
        seed: 0x5eed_c11e_7e11_0f01,
        ..run
    });
}

/// New inputs on every run, from the clock's seed (or `SHARDGATE_FUZZ_SEED`), printed.
#[test]
fn mutation_fuzz_from_a_random_seed() {
    mutation_fuzz(Run::from_env(2));
}

fn mutation_fuzz(run: Run) {
    let (secs, seed) = (run.seconds, run.seed);
    eprintln!("fuzz_sni: SHARDGATE_FUZZ_SEED={seed} for {secs}s");
    let seeds = seeds();
    let mut rng = run.rng();
    let deadline = run.deadline();
    let mut runs = 0u64;
    let mut outcomes = [0u64; 3];
    while Instant::now() < deadline {
        for _ in 0..64 {
            let mut input = seeds[rng.below(seeds.len())].clone();
            mutate(&mut rng, &seeds, &mut input);
            let result = std::panic::catch_unwind(|| check(&input));
            if let Err(e) = result {
                eprintln!(
                    "fuzz_sni: failing input (seed {seed}, run {runs}): {}",
                    input.iter().map(|b| format!("{b:02x}")).collect::<String>()
                );
                std::panic::resume_unwind(e);
            }
            outcomes[match parse(&input) {
                Parsed::Hello { .. } => 0,
                Parsed::NotTls(_) => 1,
                Parsed::Incomplete { .. } => 2,
            }] += 1;
            runs += 1;
        }
    }
    eprintln!(
        "fuzz_sni: {runs} inputs: {} hellos, {} refused, {} incomplete",
        outcomes[0], outcomes[1], outcomes[2]
    );
    assert!(runs > 100, "{runs} runs");
    assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
}

fn dns_label() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        check(&bytes);
        let mut tls = vec![22, 3, 1];
        tls.extend_from_slice(&bytes);
        check(&tls);
    }

    #[test]
    fn any_name_in_any_fragmentation_reads_back(
        labels in proptest::collection::vec(dns_label(), 1..5),
        pad in 0usize..3000,
        size in 1usize..2000,
        cut in any::<prop::sample::Index>(),
    ) {
        let name = labels.join(".");
        let hello = client_hello(Some(&name), pad);
        let split = records(&message(&hello), size);
        match parse(&split) {
            Parsed::Hello { sni, len } => {
                prop_assert_eq!(sni.map(|s| s.to_string()), Some(name.clone()));
                prop_assert_eq!(len, split.len());
            }
            other => prop_assert!(false, "{:?}", other),
        }
        let at = cut.index(split.len());
        let incomplete = matches!(parse(&split[..at]), Parsed::Incomplete { .. });
        prop_assert!(incomplete, "prefix {} of {}", at, split.len());
    }
}
