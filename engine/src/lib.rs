//! memra-engine: runtime pieces behind the `memra` binary.

pub mod inspect;
