//! An experiment, not part of shardgate: a relay on raw io_uring with the options tokio-uring
//! does not expose (multishot receive into a provided buffer ring, multishot accept,
//! `DEFER_TASKRUN` and `SINGLE_ISSUER`, every submission of a loop turn in one
//! `io_uring_enter`), to measure what io_uring could save against epoll on this kernel.
//! One thread. Usage: uring-ring LISTEN BACKEND
//! `URING_PLAIN=1` sets the ring up without `DEFER_TASKRUN`/`SINGLE_ISSUER`/`COOP_TASKRUN`.
use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{IntoRawFd, RawFd};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

const NBUF: u16 = 1024;
const BUF: usize = 16 * 1024;
const GROUP: u16 = 0;

const RECV: u64 = 0;
const SEND: u64 = 1;
const ACCEPT: u64 = 2;

fn key(slot: usize, op: u64, dir: usize) -> u64 {
    ((slot as u64) << 8) | (op << 1) | dir as u64
}

/// The provided buffers and the ring the kernel takes them from.
struct Buffers {
    ring: *mut types::BufRingEntry,
    data: Vec<u8>,
    tail: u16,
}

impl Buffers {
    fn new(ring: &IoUring) -> Buffers {
        let layout = std::alloc::Layout::from_size_align(NBUF as usize * 16, 4096).unwrap();
        let base = unsafe { std::alloc::alloc_zeroed(layout) } as *mut types::BufRingEntry;
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(base as u64, NBUF, GROUP, 0)
                .expect("register_buf_ring");
        }
        let mut b = Buffers {
            ring: base,
            data: vec![0u8; NBUF as usize * BUF],
            tail: 0,
        };
        for bid in 0..NBUF {
            b.give(bid);
        }
        b
    }

    fn slice(&self, bid: u16, off: usize, len: usize) -> *const u8 {
        self.data[bid as usize * BUF + off..][..len].as_ptr()
    }

    /// Hands buffer `bid` back to the kernel.
    fn give(&mut self, bid: u16) {
        unsafe {
            let e = &mut *self.ring.add((self.tail & (NBUF - 1)) as usize);
            e.set_addr(self.data.as_ptr().add(bid as usize * BUF) as u64);
            e.set_len(BUF as u32);
            e.set_bid(bid);
            self.tail = self.tail.wrapping_add(1);
            let tail = types::BufRingEntry::tail(self.ring) as *const std::sync::atomic::AtomicU16;
            (*tail).store(self.tail, std::sync::atomic::Ordering::Release);
        }
    }
}

/// One client connection and its backend connection; direction `d` reads `fds[d]` and
/// writes `fds[1 - d]`.
struct Pair {
    fds: [RawFd; 2],
    /// Received and not yet sent: (buffer, offset, length).
    queue: [VecDeque<(u16, usize, usize)>; 2],
    sending: [bool; 2],
    /// A receive stopped for want of buffers, to arm again when one comes back.
    parked: [bool; 2],
    closing: bool,
    inflight: u32,
}

struct Relay {
    ring: IoUring,
    bufs: Buffers,
    pairs: Vec<Option<Pair>>,
    free: Vec<usize>,
    listener: RawFd,
    backend: SocketAddr,
    /// Receives waiting for a buffer.
    parked: usize,
}

impl Relay {
    fn push(&mut self, e: squeue::Entry) {
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit().expect("submit");
        }
    }

    fn arm_recv(&mut self, slot: usize, dir: usize) {
        let p = self.pairs[slot].as_mut().unwrap();
        p.inflight += 1;
        let e = opcode::RecvMulti::new(types::Fd(p.fds[dir]), GROUP)
            .build()
            .user_data(key(slot, RECV, dir));
        self.push(e);
    }

    fn send_next(&mut self, slot: usize, dir: usize) {
        let p = self.pairs[slot].as_mut().unwrap();
        let Some(&(bid, off, len)) = p.queue[dir].front() else {
            p.sending[dir] = false;
            return;
        };
        p.sending[dir] = true;
        p.inflight += 1;
        let fd = p.fds[1 - dir];
        let e = opcode::Send::new(types::Fd(fd), self.bufs.slice(bid, off, len), len as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(key(slot, SEND, dir));
        self.push(e);
    }

    fn close(&mut self, slot: usize) {
        let p = self.pairs[slot].as_mut().unwrap();
        if !p.closing {
            p.closing = true;
            for fd in p.fds {
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
        }
        self.reap(slot);
    }

    fn reap(&mut self, slot: usize) {
        let Some(p) = self.pairs[slot].as_ref() else {
            return;
        };
        if p.closing && p.inflight == 0 {
            let p = self.pairs[slot].take().unwrap();
            self.parked -= p.parked.iter().filter(|&&x| x).count();
            for fd in p.fds {
                unsafe { libc::close(fd) };
            }
            for q in p.queue {
                for (bid, _, _) in q {
                    self.bufs.give(bid);
                }
            }
            self.free.push(slot);
        }
    }

    fn accepted(&mut self, fd: RawFd) {
        let Ok(server) = TcpStream::connect(self.backend) else {
            unsafe { libc::close(fd) };
            return;
        };
        let _ = server.set_nodelay(true);
        let one: libc::c_int = 1;
        unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                &one as *const _ as *const libc::c_void,
                4,
            );
        }
        let pair = Pair {
            fds: [fd, server.into_raw_fd()],
            queue: [VecDeque::new(), VecDeque::new()],
            sending: [false; 2],
            parked: [false; 2],
            closing: false,
            inflight: 0,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.pairs[s] = Some(pair);
                s
            }
            None => {
                self.pairs.push(Some(pair));
                self.pairs.len() - 1
            }
        };
        self.arm_recv(slot, 0);
        self.arm_recv(slot, 1);
    }

    fn arm_accept(&mut self) {
        let e = opcode::AcceptMulti::new(types::Fd(self.listener))
            .build()
            .user_data(key(0, ACCEPT, 0));
        self.push(e);
    }

    fn unpark(&mut self) {
        // Rare: only when every buffer was taken.
        for slot in 0..self.pairs.len() {
            for dir in 0..2 {
                let parked = matches!(&self.pairs[slot], Some(p) if p.parked[dir] && !p.closing);
                if parked {
                    self.pairs[slot].as_mut().unwrap().parked[dir] = false;
                    self.parked -= 1;
                    self.arm_recv(slot, dir);
                }
            }
        }
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32) {
        let (slot, op, dir) = ((ud >> 8) as usize, (ud >> 1) & 3, (ud & 1) as usize);
        match op {
            ACCEPT => {
                if res >= 0 {
                    self.accepted(res);
                }
                if !cqueue::more(flags) {
                    self.arm_accept();
                }
            }
            RECV => {
                let more = cqueue::more(flags);
                let p = self.pairs[slot].as_mut().unwrap();
                if !more {
                    p.inflight -= 1;
                }
                if res > 0 {
                    let bid = cqueue::buffer_select(flags).expect("buffer id");
                    if p.closing {
                        self.bufs.give(bid);
                    } else {
                        p.queue[dir].push_back((bid, 0, res as usize));
                        if !p.sending[dir] {
                            self.send_next(slot, dir);
                        }
                        if !more {
                            self.arm_recv(slot, dir);
                        }
                    }
                } else if res == -libc::ENOBUFS && !p.closing {
                    p.parked[dir] = true;
                    self.parked += 1;
                } else if !more {
                    // End of stream or an error: this experiment closes both ways.
                    self.close(slot);
                }
                self.reap(slot);
            }
            SEND => {
                let p = self.pairs[slot].as_mut().unwrap();
                p.inflight -= 1;
                if res < 0 || p.closing {
                    self.close(slot);
                    return;
                }
                let front = p.queue[dir].front_mut().unwrap();
                if (res as usize) < front.2 {
                    front.1 += res as usize;
                    front.2 -= res as usize;
                    self.send_next(slot, dir);
                    return;
                }
                let (bid, _, _) = p.queue[dir].pop_front().unwrap();
                self.bufs.give(bid);
                self.send_next(slot, dir);
                if self.parked > 0 {
                    self.unpark();
                }
            }
            _ => unreachable!(),
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().expect("LISTEN").parse().expect("LISTEN addr");
    let backend: SocketAddr = args.next().expect("BACKEND").parse().expect("BACKEND addr");
    let plain = std::env::var_os("URING_PLAIN").is_some();
    let mut b = IoUring::builder();
    if !plain {
        b.setup_single_issuer()
            .setup_defer_taskrun()
            .setup_coop_taskrun();
    }
    let ring = b.build(4096).expect("io_uring");
    let listener = TcpListener::bind(listen).expect("bind");
    let bufs = Buffers::new(&ring);
    let mut relay = Relay {
        ring,
        bufs,
        pairs: Vec::new(),
        free: Vec::new(),
        listener: listener.into_raw_fd(),
        backend,
        parked: 0,
    };
    relay.arm_accept();
    let mut done = Vec::with_capacity(1024);
    // With URING_STATS set: after each million completions, how many one io_uring_enter
    // reaped on average.
    let stats = std::env::var_os("URING_STATS").is_some();
    let (mut turns, mut cqes) = (0u64, 0u64);
    loop {
        relay.ring.submit_and_wait(1).expect("io_uring_enter");
        done.extend(
            relay
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
        if stats {
            turns += 1;
            cqes += done.len() as u64;
            if cqes >= 1_000_000 {
                eprintln!(
                    "{:.2} completions per io_uring_enter",
                    cqes as f64 / turns as f64
                );
                (turns, cqes) = (0, 0);
            }
        }
        for (ud, res, flags) in done.drain(..) {
            relay.complete(ud, res, flags);
        }
    }
}
