//! The README's first command runs this demo; it must keep working.

use std::process::Command;

#[test]
fn the_demo_runs_a_cluster_client_through_the_proxy_and_stops_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardgate-demo"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("answers: -MOVED"), "{stdout}");
    for shard in 0..3 {
        assert!(
            stdout.contains(&format!("\"hello from shard {shard}\"")),
            "{stdout}"
        );
    }
    // The client was only ever handed proxy addresses.
    let slots: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("slots ") && l.contains("->"))
        .collect();
    assert_eq!(slots.len(), 3, "{stdout}");
    assert!(
        slots.iter().all(|l| l
            .split("-> ")
            .nth(1)
            .unwrap()
            .split(", ")
            .all(|a| a.starts_with("127.0.0.1:"))),
        "{stdout}"
    );
    assert!(stdout.contains("stopped cleanly"), "{stdout}");
}
