//! Unmounting what a node mounted (container root filesystems, volumes, Secret tmpfs,
//! network namespace files), deepest first, from the run's mount namespace.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use nix::mount::{MntFlags, umount2};

/// Mount points at or below `prefix`, from `/proc/self/mountinfo` (field 5; octal escapes
/// such as `\040` for a space decoded).
pub fn mounts_below(prefix: &Path) -> Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    Ok(parse_mountinfo(&info)
        .into_iter()
        .filter(|m| m.starts_with(prefix))
        .collect())
}

fn unescape(field: &str) -> String {
    let mut out = String::new();
    let b = field.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(v as char);
            i += 4;
            continue;
        }
        out.push(b[i] as char);
        i += 1;
    }
    out
}

fn parse_mountinfo(info: &str) -> Vec<PathBuf> {
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape(m)))
        .collect()
}

/// Lazily unmount every mount point at or below `prefix`, deepest (latest) first.
pub fn unmount_below(prefix: &Path) -> Result<usize> {
    let mut points = mounts_below(prefix)?;
    points.reverse();
    let mut n = 0;
    for p in points {
        match umount2(&p, MntFlags::MNT_DETACH) {
            Ok(()) => n += 1,
            // Gone with its parent already.
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(e).with_context(|| format!("unmounting {}", p.display())),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_field_five_unescaped() {
        let info = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n\
                    37 36 0:5 / /run/x rw - tmpfs tmpfs rw\n";
        assert_eq!(
            parse_mountinfo(info),
            vec![PathBuf::from("/mnt/a b"), PathBuf::from("/run/x")]
        );
    }
}
