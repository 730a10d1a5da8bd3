//! Temporary: the properties modules being moved to tiny models (merged into tests/properties).

#[path = "../common/mod.rs"]
mod common;

#[path = "../properties/abort_cycles.rs"]
mod abort_cycles;
#[path = "../properties/cli.rs"]
mod cli;
#[path = "../properties/counters.rs"]
mod counters;
#[path = "../properties/ledger.rs"]
mod ledger;
#[path = "../properties/non_finite.rs"]
mod non_finite;
#[path = "../properties/streaming.rs"]
mod streaming;
