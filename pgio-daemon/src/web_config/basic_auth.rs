//! HTTP basic auth against bcrypt hashes, priced so that neither a scraper nor an attacker
//! makes pgio spend much CPU:
//! - bcrypt (tens to hundreds of ms by design) runs on the blocking pool, never on the async
//!   workers that serve /metrics and /healthz;
//! - a password that verified is remembered (a SHA-256 of user and password, `MAX_REMEMBERED`
//!   at most), so a scraper costs one bcrypt per pgio start, not one per scrape;
//! - at most `MAX_VERIFYING` verifications run at once and `MAX_PENDING` may wait: a flood of
//!   wrong passwords costs at most one core, and requests past that are answered 429 at once
//!   (their connections go back to idle, where the connection cap can evict them).
use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use base64::Engine as _;
use tokio::sync::Semaphore;

use crate::lock;

/// bcrypt runs at once; one core at most, on nodes where pgio may have two.
const MAX_VERIFYING: usize = 1;
/// Requests verifying or waiting to; past this they are told to retry.
const MAX_PENDING: usize = 4;
/// Passwords remembered as verified; forgotten all at once past this (only passwords that
/// verified get here, so only someone who knows one can cycle them).
const MAX_REMEMBERED: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No `Authorization: Basic` header, or one that does not decode.
    Missing,
    /// Unknown user or wrong password.
    Wrong,
    /// Too many verifications in progress: retry.
    Busy,
}

/// Counted for `pgio_http_auth_*`.
#[derive(Debug, Default)]
pub struct AuthStats {
    pub missing: AtomicU64,
    pub wrong: AtomicU64,
    pub busy: AtomicU64,
    /// bcrypt verifications run (remembered passwords need none).
    pub verifications: AtomicU64,
}

pub struct BasicAuth {
    /// User name → bcrypt hash.
    users: HashMap<String, String>,
    /// A configured user's hash: an unknown user's password is checked against it, so the
    /// answer takes as long as for a known user (no user-name oracle).
    decoy: String,
    remembered: Mutex<HashSet<[u8; 32]>>,
    verifying: Arc<Semaphore>,
    pending: AtomicUsize,
    pub stats: AuthStats,
}

impl std::fmt::Debug for BasicAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut users: Vec<&String> = self.users.keys().collect();
        users.sort();
        f.debug_struct("BasicAuth").field("users", &users).finish()
    }
}

impl BasicAuth {
    /// `users` must not be empty and hold valid bcrypt hashes (`web_config` checks both).
    pub fn new(users: HashMap<String, String>) -> BasicAuth {
        let decoy = users
            .iter()
            .min_by_key(|(name, _)| name.as_str())
            .map(|(_, hash)| hash.clone())
            .unwrap_or_default();
        BasicAuth {
            users,
            decoy,
            remembered: Mutex::new(HashSet::new()),
            verifying: Arc::new(Semaphore::new(MAX_VERIFYING)),
            pending: AtomicUsize::new(0),
            stats: AuthStats::default(),
        }
    }

    pub fn users(&self) -> usize {
        self.users.len()
    }

    /// Whether the request's `Authorization` header names a user and its password.
    pub async fn check(self: &Arc<Self>, authorization: Option<&[u8]>) -> Verdict {
        let verdict = self.verdict(authorization).await;
        let counter = match verdict {
            Verdict::Allowed => return verdict,
            Verdict::Missing => &self.stats.missing,
            Verdict::Wrong => &self.stats.wrong,
            Verdict::Busy => &self.stats.busy,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        verdict
    }

    async fn verdict(self: &Arc<Self>, authorization: Option<&[u8]>) -> Verdict {
        let Some((user, password)) = authorization.and_then(parse_basic) else {
            return Verdict::Missing;
        };
        let key = remembered_key(&user, &password);
        if lock(&self.remembered).contains(&key) {
            return Verdict::Allowed;
        }
        if self.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return Verdict::Busy;
        }
        let _pending = Pending(&self.pending);
        let Ok(permit) = self.verifying.clone().acquire_owned().await else {
            return Verdict::Busy;
        };
        let this = self.clone();
        // The permit goes with the bcrypt: a client that hangs up does not free its slot
        // before the CPU is spent.
        let verified = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            this.verify(&user, &password)
        })
        .await
        .unwrap_or(false);
        if !verified {
            return Verdict::Wrong;
        }
        let mut remembered = lock(&self.remembered);
        if remembered.len() >= MAX_REMEMBERED {
            remembered.clear();
        }
        remembered.insert(key);
        Verdict::Allowed
    }

    fn verify(&self, user: &Option<String>, password: &[u8]) -> bool {
        self.stats.verifications.fetch_add(1, Ordering::Relaxed);
        let hash = user.as_ref().and_then(|u| self.users.get(u));
        let matches = bcrypt::verify(password, hash.unwrap_or(&self.decoy)).unwrap_or(false);
        matches && hash.is_some()
    }
}

struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `Basic base64(user:password)` (RFC 7617; the scheme in any case). The user is None when it
/// is not UTF-8: no configured user can match it.
fn parse_basic(value: &[u8]) -> Option<(Option<String>, Vec<u8>)> {
    let value = value.trim_ascii();
    let (scheme, credentials) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"basic ") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(credentials.trim_ascii())
        .ok()?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok();
    Some((user, decoded[colon + 1..].to_vec()))
}

/// What is remembered of a verified password: a digest, never the password.
fn remembered_key(user: &Option<String>, password: &[u8]) -> [u8; 32] {
    let user = user.as_deref().unwrap_or_default().as_bytes();
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    // Length-prefixed, so no (user, password) split of the same bytes collides.
    ctx.update(&(user.len() as u64).to_le_bytes());
    ctx.update(user);
    ctx.update(password);
    let mut key = [0u8; 32];
    key.copy_from_slice(ctx.finish().as_ref());
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(user: &str, password: &str) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        format!("Basic {b64}").into_bytes()
    }

    #[test]
    fn parses_basic_credentials() {
        assert_eq!(
            parse_basic(&header("scraper", "a:b")),
            Some((Some("scraper".into()), b"a:b".to_vec()))
        );
        assert_eq!(
            parse_basic(b"bAsIc c2NyYXBlcjpz"),
            Some((Some("scraper".into()), b"s".to_vec()))
        );
        assert_eq!(parse_basic(b"Bearer c2NyYXBlcjpz"), None);
        assert_eq!(parse_basic(b"Basic !!!"), None);
        // No colon: not user:password.
        assert_eq!(parse_basic(b"Basic c2NyYXBlcg=="), None);
        assert_eq!(parse_basic(b"Basic"), None);
    }

    #[test]
    fn remembered_keys_do_not_collide_across_the_split() {
        assert_ne!(
            remembered_key(&Some("ab".into()), b"c"),
            remembered_key(&Some("a".into()), b"bc")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verifies_once_then_remembers() {
        let hash = bcrypt::hash("right", 4).expect("hash");
        let auth = Arc::new(BasicAuth::new(HashMap::from([("scraper".into(), hash)])));
        assert_eq!(auth.check(None).await, Verdict::Missing);
        let right = header("scraper", "right");
        let wrong = header("scraper", "wrong");
        assert_eq!(auth.check(Some(&wrong)).await, Verdict::Wrong);
        assert_eq!(
            auth.check(Some(&header("nobody", "right"))).await,
            Verdict::Wrong
        );
        for _ in 0..5 {
            assert_eq!(auth.check(Some(&right)).await, Verdict::Allowed);
        }
        assert_eq!(auth.stats.verifications.load(Ordering::Relaxed), 3);
        assert_eq!(auth.stats.wrong.load(Ordering::Relaxed), 2);
        assert_eq!(auth.stats.missing.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_is_bounded() {
        // Cost 10: a few ms to tens of ms each, long enough for the flood to overlap.
        let hash = bcrypt::hash("right", 10).expect("hash");
        let auth = Arc::new(BasicAuth::new(HashMap::from([("scraper".into(), hash)])));
        let right = header("scraper", "right");
        assert_eq!(auth.check(Some(&right)).await, Verdict::Allowed);
        let flood: Vec<_> = (0..20)
            .map(|i| {
                let auth = auth.clone();
                tokio::spawn(
                    async move { auth.check(Some(&header("scraper", &i.to_string()))).await },
                )
            })
            .collect();
        // A remembered password gets in during the flood.
        assert_eq!(auth.check(Some(&right)).await, Verdict::Allowed);
        let mut busy = 0;
        for f in flood {
            match f.await.expect("join") {
                Verdict::Busy => busy += 1,
                v => assert_eq!(v, Verdict::Wrong),
            }
        }
        let ran = auth.stats.verifications.load(Ordering::Relaxed);
        // All but the few admitted are turned away (some slack for a slow scheduler).
        assert!(busy >= 10, "{busy} busy, {ran} verified");
        assert_eq!(ran as usize, 1 + 20 - busy);
    }
}
