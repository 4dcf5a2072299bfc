//! What duet's command-line tools share: reaching a coordinator as a caller does.

pub mod connect;
