//! The accounts the plain tower and gRPC examples debit: a read and a write
//! with a pause between, so that two debits of one account at once lose one,
//! and a gauge that shows whether they ever ran at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What a new account holds.
pub const OPENING_BALANCE: i64 = 100;

/// The accounts, and a gauge of the debits in progress (to show they never
/// overlap).
#[derive(Default)]
pub struct Bank {
    balances: Mutex<HashMap<String, i64>>,
    in_flight: AtomicUsize,
    /// The most debits ever in progress at once.
    pub max_in_flight: AtomicUsize,
}

impl Bank {
    /// Debits `account` in two steps, a read and a write, and returns the new
    /// balance: safe only while the account's lock is held.
    pub async fn debit(&self, account: &str, amount: i64) -> i64 {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let balance = self.balance(account);
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.balances
            .lock()
            .unwrap()
            .insert(account.to_owned(), balance - amount);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        balance - amount
    }

    /// The balance of `account`.
    pub fn balance(&self, account: &str) -> i64 {
        let balances = self.balances.lock().unwrap();
        balances.get(account).copied().unwrap_or(OPENING_BALANCE)
    }
}
