//! The route table and where it comes from.
//!
//! [`table`] holds the lookup side (port → node), [`source`] the trait every producer of
//! tables implements and the [`source::RoutePublisher`] that validates and swaps tables,
//! and [`sources`] the producers: a YAML file and a seed node.

pub mod backend;
pub mod source;
pub mod sources;
pub mod table;

pub use backend::{Backend, Host};
pub use source::{RoutePublisher, RouteSource};
pub use table::{Route, RouteRx, RouteTable, Routes};
