//! The harness's own load generator, for what redis-benchmark does not measure: one client's
//! latency with a fine histogram, through every data plane in turns, a new connection per request, idle connections, and a
//! cluster client that follows `-MOVED` redirects. Blocking sockets on plain threads: the
//! fewest moving parts between the clock and the wire.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;

use crate::tls::TlsFiles;

/// A reply, as far as the harness needs to know it.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+...`, `:...`, a bulk string or a null.
    Ok,
    /// `-...`: the whole line without the `-`.
    Error(String),
}

/// One connection with a read buffer.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Result<Conn> {
        let stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 * 1024, stream),
        })
    }

    /// Sends `args` as a RESP array and reads one reply.
    pub fn call(&mut self, args: &[&[u8]]) -> Result<Reply> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.reader.get_mut().write_all(&out)?;
        self.read_reply()
    }

    fn read_reply(&mut self) -> Result<Reply> {
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if line.len() < 3 || !line.ends_with(b"\r\n") {
            bail!(
                "connection closed or short reply: {:?}",
                String::from_utf8_lossy(&line)
            );
        }
        let body = &line[1..line.len() - 2];
        match line[0] {
            b'+' | b':' => Ok(Reply::Ok),
            b'-' => Ok(Reply::Error(String::from_utf8_lossy(body).into_owned())),
            b'$' => {
                let len: i64 = std::str::from_utf8(body)?.parse()?;
                if len >= 0 {
                    let mut skip = (len as u64 + 2) as usize;
                    while skip > 0 {
                        let buf = self.reader.fill_buf()?;
                        if buf.is_empty() {
                            bail!("connection closed inside a bulk string");
                        }
                        let n = buf.len().min(skip);
                        self.reader.consume(n);
                        skip -= n;
                    }
                }
                Ok(Reply::Ok)
            }
            other => bail!("unexpected reply type {:?}", other as char),
        }
    }
}

/// What one run of the generator did.
pub struct Outcome {
    pub requests: u64,
    pub elapsed: Duration,
    /// Round-trip percentiles in microseconds (latency runs only).
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
}

impl Outcome {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// One client per data plane, pipeline 1, side by side: a connection to each of `addrs`
/// and a GET of `key` to each in turn, `requests` to each, every round trip in that data
/// plane's HDR histogram (1 ns to 10 s, 3 significant digits). Run one data plane after
/// another, as the other workloads are, this machine's drift (±20% between runs seconds
/// apart, and the same binary measured twice 0.7 to 1.3× itself) swamped the differences
/// of a few microseconds that a lone client sees; taken in turns, a request apart, every
/// data plane meets the same machine. The order is shuffled for each cycle: what ran just
/// before a round trip (another process, or the same program's code already in the cache)
/// moves it by a few percent, and a fixed order gave each data plane the same predecessor
/// every time. A data plane's elapsed time is the sum of its own round
/// trips: what one client would see with the data plane to itself.
pub fn latency_side_by_side(
    addrs: &[SocketAddr],
    key: &str,
    requests: u64,
) -> Result<Vec<Outcome>> {
    let mut conns = addrs
        .iter()
        .map(|&a| Conn::open(a))
        .collect::<Result<Vec<_>>>()?;
    let mut hists = addrs
        .iter()
        .map(|_| Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3))
        .collect::<Result<Vec<_>, _>>()?;
    let mut elapsed = vec![Duration::ZERO; addrs.len()];
    let get = [&b"GET"[..], key.as_bytes()];
    // Warm every path (connection to the node, buffers) before timing.
    for conn in &mut conns {
        for _ in 0..100 {
            conn.call(&get)?;
        }
    }
    let n = conns.len();
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..requests {
        rng.shuffle(&mut order);
        for &j in &order {
            let t = Instant::now();
            let reply = conns[j].call(&get);
            let took = t.elapsed();
            if let Reply::Error(e) =
                reply.with_context(|| format!("GET {key} through {}", addrs[j]))?
            {
                bail!("GET {key} through {}: -{e}", addrs[j]);
            }
            hists[j].record(took.as_nanos() as u64)?;
            elapsed[j] += took;
        }
    }
    Ok(hists
        .iter()
        .zip(elapsed)
        .map(|(hist, elapsed)| Outcome {
            requests,
            elapsed,
            p50_us: Some(hist.value_at_quantile(0.50) as f64 / 1000.0),
            p99_us: Some(hist.value_at_quantile(0.99) as f64 / 1000.0),
        })
        .collect())
}

/// A small xorshift generator: the harness's shuffles need no quality, only no pattern.
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Fisher-Yates.
    fn shuffle(&mut self, v: &mut [usize]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// A new connection per request: connect, GET `key`, read the reply, close; `threads`
/// clients in parallel, `requests` in all.
pub fn churn(addr: SocketAddr, key: &str, requests: u64, threads: u64) -> Result<Outcome> {
    let start = Instant::now();
    let per = requests / threads;
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || -> Result<()> {
                    for _ in 0..per {
                        let mut conn = Conn::open(addr)?;
                        if let Reply::Error(e) = conn.call(&[b"GET", key.as_bytes()])? {
                            bail!("GET {key}: -{e}");
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("churn client panicked")))
            .collect()
    });
    for r in results {
        r?;
    }
    Ok(Outcome {
        requests: per * threads,
        elapsed: start.elapsed(),
        p50_us: None,
        p99_us: None,
    })
}

/// Opens `count` connections, each answered one PING (so the data plane has dialled the
/// backend and moved bytes both ways), over TLS with `tls`, and calls `measure` while they
/// are all open.
pub fn with_idle<T>(
    addr: SocketAddr,
    count: usize,
    tls: Option<&TlsFiles>,
    measure: impl FnOnce() -> T,
) -> Result<T> {
    let mut plain = Vec::new();
    let mut secured = Vec::new();
    for i in 0..count {
        let what = || format!("idle connection {i} of {count} to {addr}");
        match tls {
            None => {
                let mut s = TcpStream::connect(addr).with_context(what)?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                crate::tls::ping(&mut s).with_context(what)?;
                plain.push(s);
            }
            Some(files) => {
                let mut s = files.connect(addr).with_context(what)?;
                crate::tls::ping(&mut s).with_context(what)?;
                secured.push(s);
            }
        }
    }
    Ok(measure())
}

/// A cluster client that follows redirects: GET of `requests` distinct keys, each sent first
/// to an entry node picked round robin (so most land on the wrong shard), then to wherever
/// `-MOVED` points; `threads` clients in parallel. Returns the outcome and the redirects.
pub fn moved(entries: &[SocketAddr], requests: u64, threads: u64) -> Result<(Outcome, u64)> {
    let start = Instant::now();
    let per = requests / threads;
    let results: Vec<Result<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<u64> {
                    let mut conns: HashMap<SocketAddr, Conn> = HashMap::new();
                    let mut redirects = 0;
                    for i in 0..per {
                        let key = format!("moved:{t}:{i}");
                        let mut to = entries[(i as usize) % entries.len()];
                        for hop in 0.. {
                            if hop > 2 {
                                bail!("GET {key}: more than two redirects");
                            }
                            let conn = match conns.entry(to) {
                                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                                std::collections::hash_map::Entry::Vacant(e) => {
                                    e.insert(Conn::open(to)?)
                                }
                            };
                            match conn.call(&[b"GET", key.as_bytes()])? {
                                Reply::Ok => break,
                                Reply::Error(e) if e.starts_with("MOVED ") => {
                                    redirects += 1;
                                    let target = e.rsplit(' ').next().unwrap_or_default();
                                    to = target
                                        .parse()
                                        .with_context(|| format!("MOVED target {target:?}"))?;
                                }
                                Reply::Error(e) => bail!("GET {key}: -{e}"),
                            }
                        }
                    }
                    Ok(redirects)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("cluster client panicked"))
            })
            .collect()
    });
    let mut redirects = 0;
    for r in results {
        redirects += r?;
    }
    Ok((
        Outcome {
            requests: per * threads,
            elapsed: start.elapsed(),
            p50_us: None,
            p99_us: None,
        },
        redirects,
    ))
}
