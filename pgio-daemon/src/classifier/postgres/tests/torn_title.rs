use super::*;

/// A look between PostgreSQL's title write and the padding after it (seen in 5 of 6,600
/// `pgbench -C` backends): the old arguments still follow the title, which can be cut
/// anywhere. Classified as one was, it was `role="other"` for a millisecond, long enough to
/// lose its connection's query.
#[test]
fn a_title_being_written_is_not_classified_yet() {
    let c = Clusters::default();
    let torn = |argv: &[&str]| {
        let mut p = in_dir(5, &argv.join(" "), "/srv/a");
        p.argv = argv.iter().map(|a| (*a).to_owned()).collect();
        c.classify(&p).map(|l| (l.role, l.database))
    };
    let starting = Some((STARTING.to_owned(), String::new()));
    assert_eq!(
        torn(&[
            "postgres: postgres shop [local] ",
            "D",
            "/srv/a",
            "-p",
            "5432"
        ]),
        starting
    );
    assert_eq!(
        torn(&["postgres: postgres sql/15/bin/postgres", "-D", "/srv/a"]),
        starting
    );
    assert_eq!(
        torn(&["postgres: postgres shop [local] idle"]),
        Some(("client backend".to_owned(), "shop".to_owned())),
        "padded: one argument"
    );
}
