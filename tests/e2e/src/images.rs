//! The container images the cluster runs: OCI archives that `scripts/images.sh oci` builds
//! without a daemon into `target/images/` (the operator and dataplane from their
//! Dockerfiles, FROM scratch with static binaries, and the static pause image), listed in
//! `target/images/images.txt` as `REPOSITORY TAG ARCHIVE` lines. Each node's containerd
//! imports them under exactly those names, which are the chart's and the examples'.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::proc::run;
use crate::repo_root;

/// The tag `helm upgrade` moves to in the suite: the same images under a second tag (a new
/// tag is what a user's upgrade changes; the bits need not differ to prove the rollout).
pub const UPGRADE_SUFFIX: &str = "-upgrade";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub repository: String,
    pub tag: String,
    pub archive: PathBuf,
    /// More tags for the same image (the suite's upgrade tag).
    pub extra_tags: Vec<String>,
}

impl Image {
    /// `repository:tag`.
    pub fn reference(&self) -> String {
        format!("{}:{}", self.repository, self.tag)
    }

    /// Import into the containerd at `socket` (namespace `k8s.io`, where the CRI looks),
    /// under its repository and tag, then add the extra tags.
    pub async fn import(&self, ctr: &Path, socket: &Path) -> Result<()> {
        let (ctr, sock) = (ctr.display().to_string(), socket.display().to_string());
        let archive = self.archive.display().to_string();
        run(
            &ctr,
            &[
                "-a",
                &sock,
                "-n",
                "k8s.io",
                "images",
                "import",
                "--base-name",
                &self.repository,
                &archive,
            ],
        )
        .await
        .with_context(|| format!("importing {} from {archive}", self.reference()))?;
        for t in &self.extra_tags {
            let to = format!("{}:{t}", self.repository);
            run(
                &ctr,
                &[
                    "-a",
                    &sock,
                    "-n",
                    "k8s.io",
                    "images",
                    "tag",
                    "--force",
                    &self.reference(),
                    &to,
                ],
            )
            .await
            .with_context(|| format!("tagging {} as {to}", self.reference()))?;
        }
        Ok(())
    }
}

/// Parse `images.txt` (archives relative to its directory).
pub fn parse_list(text: &str, dir: &Path) -> Result<Vec<Image>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let [repo, tag, file] = f.as_slice() else {
            bail!(
                "images.txt line {}: expected REPOSITORY TAG ARCHIVE, got {line:?}",
                i + 1
            );
        };
        if !repo.contains('/') || !repo.split('/').next().unwrap_or("").contains('.') {
            bail!(
                "images.txt line {}: {repo:?} is not fully qualified (containerd's CRI finds only registry/name references)",
                i + 1
            );
        }
        out.push(Image {
            repository: repo.to_string(),
            tag: tag.to_string(),
            archive: dir.join(file),
            extra_tags: Vec::new(),
        });
    }
    Ok(out)
}

/// The images `scripts/images.sh oci` built, with the operator's and the dataplane's
/// upgrade tag added.
pub fn built() -> Result<Vec<Image>> {
    let dir = repo_root().join("target/images");
    let list = dir.join("images.txt");
    let text = std::fs::read_to_string(&list).with_context(|| {
        format!(
            "{}: build the images first (`make images`, or `scripts/images.sh oci`)",
            list.display()
        )
    })?;
    let mut images = parse_list(&text, &dir)?;
    for i in &mut images {
        if !i.archive.exists() {
            bail!("{} is missing: rebuild the images", i.archive.display());
        }
        if !i.repository.ends_with("/pause") {
            i.extra_tags.push(format!("{}{UPGRADE_SUFFIX}", i.tag));
        }
    }
    for want in ["/operator", "/dataplane", "/pause"] {
        if !images.iter().any(|i| i.repository.ends_with(want)) {
            bail!("{} lists no *{want} image", list.display());
        }
    }
    Ok(images)
}

/// The built image whose repository ends with `/<name>`.
pub fn find<'a>(images: &'a [Image], name: &str) -> Result<&'a Image> {
    images
        .iter()
        .find(|i| i.repository.ends_with(&format!("/{name}")))
        .with_context(|| format!("no {name} image was built"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_names_fully_qualified_images() {
        let dir = Path::new("/t/images");
        let v = parse_list(
            "# built by scripts/images.sh\nghcr.io/tandem/dataplane 0.1.0 dataplane.tar\n",
            dir,
        )
        .unwrap();
        assert_eq!(v[0].reference(), "ghcr.io/tandem/dataplane:0.1.0");
        assert_eq!(v[0].archive, dir.join("dataplane.tar"));
        assert!(parse_list("tandem/dataplane 0.1.0 d.tar", dir).is_err());
        assert!(parse_list("ghcr.io/tandem/dataplane 0.1.0", dir).is_err());
    }
}
