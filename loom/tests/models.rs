//! One test per model; each model's documentation says what it proves.
#![cfg(loom)]

use tower_lock::loom_models::{cohort, lost, memory};

#[test]
fn lost_a_fire_racing_a_subscribing_waiter_always_wakes_it() {
    lost::a_fire_racing_a_subscribing_waiter_always_wakes_it();
}

#[test]
fn lost_racing_fires_keep_one_reason() {
    lost::racing_fires_keep_one_reason();
}

#[test]
fn lost_a_dropped_wait_racing_a_fire_loses_nothing() {
    lost::a_dropped_wait_racing_a_fire_loses_nothing();
}

#[test]
fn memory_acquire_release_and_a_cancelled_wait_leave_one_holder_and_no_entry() {
    memory::acquire_release_and_a_cancelled_wait_leave_one_holder_and_no_entry();
}

#[test]
fn cohort_a_hand_off_racing_a_revocation_and_a_new_waiter_keeps_exclusion() {
    cohort::a_hand_off_racing_a_revocation_and_a_new_waiter_keeps_exclusion();
}
