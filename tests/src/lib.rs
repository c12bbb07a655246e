//! memra-tests: helpers shared by the integration tests (fixture paths, the fetched model).
