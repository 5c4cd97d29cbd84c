//! The producers of route tables.

pub mod file;
pub mod seed;

pub use file::FileSource;
pub use seed::SeedSource;
