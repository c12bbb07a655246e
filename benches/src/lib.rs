//! memra-benches: shared helpers for the criterion benches in `benches/`.
