//! The OpenAPI checks an API server makes on a `PDDeployment`, made locally against the
//! CRD's own schema (the one `crdgen` writes to `crds/`), so a manifest the local runtime
//! accepts is one a cluster would accept, and a mistake is reported with the field's path
//! instead of being dropped by serde (unknown fields) or caught only by a process.
//!
//! Covered: `type` (and int-or-string), `required`, unknown fields (`properties` without
//! `additionalProperties`), `nullable`, `enum`, `minimum`/`maximum`,
//! `minLength`/`maxLength`, `items`, `additionalProperties`. CEL rules are not evaluated.

use serde_json::Value;

/// Every violation of `schema` by `value`, each as `path: what is wrong`.
pub fn violations(schema: &Value, value: &Value, path: &str) -> Vec<String> {
    let mut out = Vec::new();
    check(schema, value, path, &mut out);
    out
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a map",
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

fn check(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        return;
    };
    let flag = |k: &str| s.get(k).and_then(Value::as_bool).unwrap_or(false);
    if value.is_null() {
        if !flag("nullable") {
            out.push(format!("{path}: must not be null"));
        }
        return;
    }
    if flag("x-kubernetes-int-or-string") {
        let is_int = value.as_i64().is_some();
        if !is_int && !value.is_string() {
            out.push(format!(
                "{path}: expected an integer or a string, got {}",
                kind(value)
            ));
        }
        return;
    }
    let type_ok = match s.get("type").and_then(Value::as_str) {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.as_i64().is_some() || value.as_u64().is_some(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !type_ok {
        let want = s.get("type").and_then(Value::as_str).unwrap_or("?");
        out.push(format!(
            "{path}: expected {}, got {} ({})",
            match want {
                "object" => "a map",
                "array" => "a list",
                "string" => "a string",
                "integer" => "an integer",
                "number" => "a number",
                "boolean" => "a boolean (true or false)",
                other => other,
            },
            kind(value),
            short(value)
        ));
        return;
    }
    if let Some(allowed) = s.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(|v| v.to_string()).collect();
        out.push(format!(
            "{path}: {} is not one of {}",
            short(value),
            list.join(", ")
        ));
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = s.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            out.push(format!("{path}: {value} is less than the minimum {min}"));
        }
        if let Some(max) = s.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            out.push(format!("{path}: {value} is more than the maximum {max}"));
        }
    }
    if let Some(text) = value.as_str() {
        let len = text.chars().count() as u64;
        if let Some(min) = s.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            out.push(format!(
                "{path}: must have at least {min} character(s), got {len}"
            ));
        }
        if let Some(max) = s.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            out.push(format!(
                "{path}: must have at most {max} character(s), got {len}"
            ));
        }
    }
    if let Some(items) = value.as_array()
        && let Some(item_schema) = s.get("items")
    {
        for (i, item) in items.iter().enumerate() {
            check(item_schema, item, &format!("{path}[{i}]"), out);
        }
    }
    if let Some(map) = value.as_object() {
        if let Some(required) = s.get("required").and_then(Value::as_array) {
            for r in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(r) {
                    out.push(format!("{path}.{r}: required field is missing"));
                }
            }
        }
        let props = s.get("properties").and_then(Value::as_object);
        let extra = s.get("additionalProperties");
        let preserve = flag("x-kubernetes-preserve-unknown-fields");
        for (k, v) in map {
            let child = format!("{path}.{k}");
            if let Some(p) = props.and_then(|p| p.get(k)) {
                check(p, v, &child, out);
            } else if let Some(e) = extra.filter(|e| e.is_object()) {
                check(e, v, &child, out);
            } else if props.is_some() && !preserve && extra != Some(&Value::Bool(true)) {
                let known: Vec<&str> = props
                    .map(|p| p.keys().map(String::as_str).collect())
                    .unwrap_or_default();
                out.push(format!(
                    "{child}: unknown field (known here: {})",
                    known.join(", ")
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({
            "type": "object",
            "required": ["model"],
            "properties": {
                "model": {"type": "object", "properties": {
                    "name": {"type": "string", "minLength": 1},
                }},
                "groups": {"type": "integer", "minimum": 0.0},
                "replicas": {"type": "integer", "minimum": 1.0, "maximum": 64.0},
                "policy": {"type": "string", "enum": ["CoRestartGroup", "None"]},
                "port": {"x-kubernetes-int-or-string": true},
                "image": {"type": "string", "nullable": true},
                "args": {"type": "array", "items": {"type": "string"}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            }
        })
    }

    #[test]
    fn a_valid_value_has_no_violations() {
        let v = json!({
            "model": {"name": "m"}, "groups": 0, "replicas": 64, "policy": "None",
            "port": "http", "image": null, "args": ["--x"], "labels": {"a": "b"}
        });
        assert_eq!(violations(&schema(), &v, "spec"), Vec::<String>::new());
    }

    #[test]
    fn each_rule_names_the_field() {
        let v = json!({
            "model": {"name": "", "nmae": "typo"}, "groups": -1, "replicas": 65,
            "policy": "Always", "port": 1.5, "args": [1], "labels": {"a": 2}, "extra": true
        });
        let got = violations(&schema(), &v, "spec");
        let want = [
            "spec.model.name: must have at least 1 character(s), got 0",
            "spec.model.nmae: unknown field (known here: name)",
            "spec.groups: -1 is less than the minimum 0",
            "spec.replicas: 65 is more than the maximum 64",
            "spec.policy: \"Always\" is not one of \"CoRestartGroup\", \"None\"",
            "spec.port: expected an integer or a string, got a number",
            "spec.args[0]: expected a string, got an integer (1)",
            "spec.labels.a: expected a string, got an integer (2)",
            "spec.extra: unknown field",
        ];
        for w in want {
            assert!(
                got.iter().any(|g| g.starts_with(w)),
                "missing {w:?} in {got:#?}"
            );
        }
        assert_eq!(got.len(), want.len(), "{got:#?}");
    }

    #[test]
    fn missing_required_and_null_are_reported() {
        let got = violations(&schema(), &json!({"groups": null}), "spec");
        assert!(got.contains(&"spec.model: required field is missing".to_string()));
        assert!(got.contains(&"spec.groups: must not be null".to_string()));
    }
}
