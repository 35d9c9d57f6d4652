use super::*;

const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const ID: &str = "4f5e6d7c8b9a0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796";

fn pod(uid: &str, id: Option<&str>) -> Option<PodRef> {
    Some(PodRef {
        uid: uid.to_owned(),
        container_id: id.map(str::to_owned),
    })
}

#[test]
fn cgroupfs_driver_paths() {
    for path in [
        format!("/kubepods/besteffort/pod{UID}/{ID}"),
        format!("/kubepods/burstable/pod{UID}/{ID}"),
        format!("/kubepods/pod{UID}/{ID}"),
        format!("/kubepods/besteffort/pod{UID}/libpod-{ID}"),
        format!("/kubepods/besteffort/pod{UID}/crio-{ID}"),
        format!("/kubepods/besteffort/pod{UID}/docker-{ID}.scope"),
    ] {
        assert_eq!(PodRef::parse(&path), pod(UID, Some(ID)), "{path}");
    }
    assert_eq!(
        PodRef::parse(&format!("/kubepods/besteffort/pod{UID}")),
        pod(UID, None),
        "the pod's own cgroup (its pause process, or a pod-level process)"
    );
}

#[test]
fn systemd_driver_paths() {
    let u = UID.replace('-', "_");
    for path in [
        format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope"
        ),
        format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/crio-{ID}.scope"
        ),
        format!("/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope"),
        format!("/kubepods.slice/kubepods-pod{u}.slice/docker-{ID}.scope"),
    ] {
        assert_eq!(PodRef::parse(&path), pod(UID, Some(ID)), "{path}");
    }
}

#[test]
fn paths_seen_from_a_cgroup_namespace() {
    let u = UID.replace('-', "_");
    // pgio in a besteffort pod, the process in a burstable one / in the same QoS class.
    assert_eq!(
        PodRef::parse(&format!("/../../../burstable/pod{UID}/{ID}")),
        pod(UID, Some(ID))
    );
    assert_eq!(
        PodRef::parse(&format!("/../../pod{UID}/{ID}")),
        pod(UID, Some(ID))
    );
    assert_eq!(
        PodRef::parse(&format!(
            "/../../kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope"
        )),
        pod(UID, Some(ID))
    );
}

#[test]
fn paths_that_only_look_like_a_pod() {
    let u = UID.replace('-', "_");
    for path in [
        // A user's delegated cgroup made to look like kubepods.
        format!(
            "/user.slice/user-1000.slice/user@1000.service/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope"
        ),
        format!("/../../user.slice/kubepods/pod{UID}/{ID}"),
        format!("/system.slice/pod{UID}/{ID}"),
        // Not a UID: too short, uppercase, odd bytes.
        "/kubepods/besteffort/pod1234/abc".to_owned(),
        format!("/kubepods/besteffort/pod{}/{ID}", UID.to_uppercase()),
        format!("/kubepods/besteffort/pod{}\n/{ID}", &UID[..35]),
        format!("/kubepods.slice/evil-pod{u}.slice/{ID}"),
        "/".to_owned(),
        String::new(),
    ] {
        assert_eq!(PodRef::parse(&path), None, "{path:?}");
    }
    // A pod with a container segment that is no container ID: the pod, no container.
    assert_eq!(
        PodRef::parse(&format!("/kubepods/pod{UID}/not-an-id")),
        pod(UID, None)
    );
}

#[test]
fn v1_and_v2_lines_first_pod_wins() {
    let lines = [
        "/user.slice".to_owned(),
        format!("/kubepods/besteffort/pod{UID}/{ID}"),
    ];
    assert_eq!(
        PodRef::from_cgroups(lines.iter().map(String::as_str)),
        pod(UID, Some(ID))
    );
    assert_eq!(PodRef::from_cgroups(["/", "/init.scope"]), None);
}

#[test]
fn kubelet_directory_names() {
    assert_eq!(
        parse_pod_dir(&format!("db_pg-0_{UID}")),
        Some((UID.to_owned(), "db".to_owned(), "pg-0".to_owned()))
    );
    assert_eq!(
        parse_container_log(&format!("pg-0_db_postgres-{ID}.log")),
        Some((
            ID.to_owned(),
            PodLabels {
                namespace: "db".into(),
                pod: "pg-0".into(),
                container: "postgres".into()
            }
        ))
    );
    for bad in [
        format!("db_pg\"0_{UID}"),
        format!("db_pg\n0_{UID}"),
        format!("db_PG-0_{UID}"),
        format!("db_pg-0_{UID}_x"),
        format!("db__{UID}"),
        format!("db_-pg_{UID}"),
        format!("{}_pg-0_{UID}", "n".repeat(64)),
        "db_pg-0_1234".to_owned(),
    ] {
        assert_eq!(parse_pod_dir(&bad), None, "{bad:?}");
    }
    for bad in [
        format!("pg-0_db_postgres-{ID}"),
        format!("pg-0_db_post\"gres-{ID}.log"),
        format!("pg-0_db_postgres-{}.log", &ID[1..]),
        format!("pg-0_db_postgres_{ID}.log"),
    ] {
        assert_eq!(parse_container_log(&bad), None, "{bad:?}");
    }
}

struct Dirs(PathBuf);

impl Dirs {
    fn new(name: &str) -> Dirs {
        let d = std::env::temp_dir().join(format!("pgio-pods-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("pods")).expect("pods dir");
        std::fs::create_dir_all(d.join("containers")).expect("containers dir");
        Dirs(d)
    }
    fn pods(&self) -> Pods {
        Pods::new(self.0.join("pods"), self.0.join("containers"))
    }
    fn pod(&self, ns: &str, pod: &str, uid: &str, containers: &[(&str, &str)]) {
        let dir = self.0.join("pods").join(format!("{ns}_{pod}_{uid}"));
        for (name, id) in containers {
            std::fs::create_dir_all(dir.join(name)).expect("container dir");
            let link = self
                .0
                .join("containers")
                .join(format!("{pod}_{ns}_{name}-{id}.log"));
            std::os::unix::fs::symlink(dir.join(name).join("0.log"), link).expect("symlink");
        }
    }
    fn remove_pod(&self, ns: &str, pod: &str, uid: &str) {
        std::fs::remove_dir_all(self.0.join("pods").join(format!("{ns}_{pod}_{uid}")))
            .expect("remove pod dir");
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn names_from_the_kubelets_directories() {
    let d = Dirs::new("names");
    let other = "1f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
    d.pod("db", "pg-0", UID, &[("postgres", ID), ("exporter", other)]);
    let pods = d.pods();
    let labels = |id: Option<&str>| pods.labels(&pod(UID, id).expect("ref"));
    assert_eq!(
        labels(Some(ID)),
        Some(PodLabels {
            namespace: "db".into(),
            pod: "pg-0".into(),
            container: "postgres".into()
        })
    );
    assert_eq!(
        labels(Some(other)).map(|l| l.container),
        Some("exporter".into())
    );
    // Two containers, no symlink for this ID: the pod but no container name.
    let unknown = "2f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
    assert_eq!(
        labels(Some(unknown)).map(|l| l.container),
        Some(String::new())
    );
    // A pod unknown to the kubelet gets nothing.
    let stranger = "9f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    assert_eq!(pods.labels(&pod(stranger, Some(ID)).expect("ref")), None);

    // Deleted: gone from the index at the next refresh.
    d.remove_pod("db", "pg-0", UID);
    pods.refresh();
    assert_eq!(labels(Some(ID)), None);
}

#[test]
fn a_single_container_pod_names_its_container_without_a_symlink() {
    let d = Dirs::new("single");
    std::fs::create_dir_all(d.0.join("pods").join(format!("db_pg-1_{UID}/postgres"))).expect("dir");
    let pods = d.pods();
    assert_eq!(
        pods.labels(&pod(UID, Some(ID)).expect("ref")),
        Some(PodLabels {
            namespace: "db".into(),
            pod: "pg-1".into(),
            container: "postgres".into()
        })
    );
}

#[test]
fn a_symlink_naming_another_pod_is_not_believed() {
    let d = Dirs::new("liar");
    d.pod("db", "pg-0", UID, &[("postgres", ID)]);
    let uid2 = "9f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    std::fs::create_dir_all(d.0.join("pods").join(format!("web_app-0_{uid2}/app"))).expect("dir");
    let pods = d.pods();
    // The cgroup says pod uid2, the container ID's symlink says pg-0.
    assert_eq!(pods.labels(&pod(uid2, Some(ID)).expect("ref")), None);
}

#[test]
fn a_pod_made_after_the_first_listing_is_found_on_a_miss() {
    let d = Dirs::new("late");
    let pods = d.pods();
    assert_eq!(pods.labels(&pod(UID, Some(ID)).expect("ref")), None);
    d.pod("db", "pg-0", UID, &[("postgres", ID)]);
    // No wait: the directories' mtimes changed.
    assert_eq!(
        pods.labels(&pod(UID, Some(ID)).expect("ref"))
            .map(|l| l.pod),
        Some("pg-0".into())
    );
}
