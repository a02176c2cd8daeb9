//! Print the PDDeployment CustomResourceDefinition as YAML (`make crds` writes it to
//! `crds/pddeployment.yaml`; `make crd-check` fails when the committed file is stale).

fn main() -> anyhow::Result<()> {
    print!("{}", tandem_operator::crd::crd_yaml()?);
    Ok(())
}
