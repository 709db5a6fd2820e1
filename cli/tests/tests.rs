//! alloctramp's integration tests: one binary, grouped by theme. The tests
//! build the C and C++ programs in testbins/ with gcc and g++ and run the
//! real `alloctramp` binary on them.

mod util;

mod allocators;
mod bad_input;
mod callers;
mod charge;
mod debuginfod;
mod export;
mod fault;
mod live;
mod malformed;
mod patch;
mod reliability;
mod report;
mod run;
mod runtime;
mod sites;
mod statics;
mod trace;
mod view;
