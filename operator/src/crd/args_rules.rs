//! The API server's rules on the roles' `args` (CEL in the CRD), so that a spec whose
//! members could never start, or never pair, is refused at `kubectl apply` with the field
//! named, before any pod exists:
//! - no flag the operator sets is repeated (the dataplane refuses a flag given twice, so
//!   such a pod would exit at once);
//! - the KV cache's element type (`--kv-dtype`) is the same for prefill and decode (the
//!   decode receives the prefill's KV in the prefill's layout; the handshake would refuse
//!   the pair after both pods had loaded the model). The rule compares the
//!   `--kv-dtype=VALUE` arguments, so the two-argument form `--kv-dtype VALUE` is refused
//!   on its own.
//!
//! [`crate::resources::check_role_args`] says the same to the operator and to the local
//! runtime, which has no API server (and also compares `TANDEM_KV_DTYPE` in the roles'
//! environment, which a CEL rule on `env` with `valueFrom` could not).

use schemars::Schema;
use serde_json::{Value, json};

/// Most extra arguments per role, and characters per argument: the bounds the API server
/// needs to estimate the rules' cost, far above any real command line.
pub const MAX_ARGS: u64 = 128;
pub const MAX_ARG_LENGTH: u64 = 1024;

/// The flag of the KV cache's element type.
pub const KV_DTYPE_FLAG: &str = "--kv-dtype";

/// The rule on the spec: both roles give the same `--kv-dtype=` arguments (or none).
pub const KV_DTYPE_PAIR_RULE: &str = "(has(self.prefill.args) ? self.prefill.args.filter(a, a.startsWith('--kv-dtype=')) : []) == (has(self.decode.args) ? self.decode.args.filter(a, a.startsWith('--kv-dtype=')) : [])";

/// The message of [`KV_DTYPE_PAIR_RULE`].
pub const KV_DTYPE_PAIR_MESSAGE: &str = "spec.prefill.args and spec.decode.args must give the same --kv-dtype (or neither): the decode receives the prefill's KV cache in the prefill's layout, and the handshake refuses a pair that differs";

/// The rule on a role: none of `reserved` (the operator's flags), alone or as `flag=value`.
pub fn reserved_rule(reserved: &[String]) -> String {
    let list = reserved
        .iter()
        .map(|f| format!("'{f}'"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "!has(self.args) || self.args.all(a, ![{list}].exists(f, a == f || a.startsWith(f + '=')))"
    )
}

/// Schema transform of `RoleSpec`: the bounds of `args` and the rules on it.
pub fn role_spec(schema: &mut Schema) {
    let reserved = tandem_contract::settings::reserved();
    if let Some(Value::Object(props)) = schema.get_mut("properties")
        && let Some(Value::Object(args)) = props.get_mut("args")
    {
        args.insert("maxItems".into(), json!(MAX_ARGS));
        if let Some(Value::Object(items)) = args.get_mut("items") {
            items.insert("maxLength".into(), json!(MAX_ARG_LENGTH));
        }
    }
    schema.insert(
        "x-kubernetes-validations".into(),
        json!([
            {
                "rule": reserved_rule(&reserved),
                "fieldPath": ".args",
                "message": format!(
                    "args may not repeat a flag the operator sets from spec.model, spec.transfer, spec.health and the group ({}); remove it",
                    reserved.join(", ")
                ),
            },
            {
                "rule": format!("!has(self.args) || !self.args.exists(a, a == '{KV_DTYPE_FLAG}')"),
                "fieldPath": ".args",
                "message": format!(
                    "write {KV_DTYPE_FLAG} as one argument, {KV_DTYPE_FLAG}=VALUE: prefill and decode must agree on it, which is checked in that form"
                ),
            },
        ]),
    );
}
