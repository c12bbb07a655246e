//! memra-engine: runtime pieces behind the `memra` binary.
