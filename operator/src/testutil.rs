//! Builders shared by unit tests.

use crate::crd::*;

pub mod rbac;

/// A small valid spec with `groups` groups of one prefill and one decode pod.
pub fn spec(groups: i32) -> PDDeploymentSpec {
    let role = |image: &str| RoleSpec {
        replicas: 1,
        template: PodTemplate {
            image: image.into(),
            ..Default::default()
        },
        args: vec![],
    };
    PDDeploymentSpec {
        model: ModelSpec {
            name: "smollm2".into(),
            path: "/models/smollm2.gguf".into(),
            volume: None,
        },
        groups,
        prefill: role("tandem:1"),
        decode: role("tandem:1"),
        transfer: TransferSpec::default(),
        health: HealthSpec::default(),
        restart: RestartSpec::default(),
        rollout: RolloutSpec::default(),
        router: None,
    }
}
