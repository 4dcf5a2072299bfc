//! What the end-to-end tests in `tests/` share: a test stack of the three services, its
//! clients and the HTTP API's helpers. Built once as this library, so each test binary links
//! the services' servers instead of compiling them again.

pub mod common;
