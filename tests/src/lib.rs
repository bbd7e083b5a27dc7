//! integration test helpers
