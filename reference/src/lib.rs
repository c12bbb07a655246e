//! memra-reference: naive, obviously-right f32 CPU ops — the oracles for every GPU kernel.
