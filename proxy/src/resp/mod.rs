//! RESP: the scanner that finds frame boundaries in both directions, the frame model that
//! topology replies are parsed into and re-encoded from, the request classifier, the
//! pairing of replies with requests, and the rewriters.

pub mod frame;
pub mod pairing;
pub mod request;
pub mod scanner;

pub use scanner::{RespError, Scan, Scanner};
