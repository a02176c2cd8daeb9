# The Tandem operator on an empty base: no image is pulled to build it.
#
# The context is a directory holding only the static binary (`make images` prepares it
# in target/image-context/operator): glibc linked statically (`-C target-feature=+crt-static`),
# rustls for TLS, so the binary needs no file from the image — the API server's CA and the
# token come from the service-account mount, /etc/hosts and /etc/resolv.conf from the
# kubelet.
FROM scratch
COPY tandem-operator /usr/local/bin/tandem-operator
# Numeric, so that runAsNonRoot can verify it without an /etc/passwd.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/tandem-operator"]
