//! RESP, as the data path reads it.
//!
//! - [`scanner`]: the resumable scanner that finds frame boundaries in both directions
//!   without allocating.
//! - [`frame`]: the frame model topology replies are parsed into and re-encoded from.
//! - [`request`]: the streaming request scanner (which command, and the arguments that
//!   matter).
//! - [`pairing`]: which reply answers which command (pipelining, MULTI/EXEC, CLIENT REPLY,
//!   pub/sub, MONITOR, RESP3 pushes).

pub mod frame;
pub mod pairing;
pub mod request;
pub mod scanner;

pub use scanner::{Part, RespError, Scan, Scanner};
