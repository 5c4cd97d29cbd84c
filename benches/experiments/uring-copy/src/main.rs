//! An experiment, not part of shardgate: the smallest io_uring copy loop (tokio-uring), one
//! thread, one 16 KiB buffer per direction, to measure what io_uring could save against
//! epoll on this kernel. Usage: uring-copy LISTEN BACKEND
use std::net::SocketAddr;
use std::rc::Rc;

use tokio_uring::net::{TcpListener, TcpStream};

async fn pump(from: Rc<TcpStream>, to: Rc<TcpStream>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let (r, b) = from.read(buf).await;
        let n = match r {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let (w, b) = to
            .write_all(tokio_uring::buf::BoundedBuf::slice(b, ..n))
            .await;
        buf = b.into_inner();
        if w.is_err() {
            return;
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().expect("LISTEN").parse().expect("LISTEN addr");
    let backend: SocketAddr = args.next().expect("BACKEND").parse().expect("BACKEND addr");
    tokio_uring::start(async move {
        let listener = TcpListener::bind(listen).expect("bind");
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            tokio_uring::spawn(async move {
                let Ok(server) = TcpStream::connect(backend).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (c, s) = (Rc::new(client), Rc::new(server));
                let up = tokio_uring::spawn(pump(c.clone(), s.clone()));
                pump(s, c).await;
                let _ = up.await;
            });
        }
    });
}
