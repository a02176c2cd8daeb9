# The Tandem dataplane (CPU backend) on an empty base: no image is pulled to build it.
#
# The context is a directory holding only the static binary (`make images` prepares it
# in target/image-context/dataplane): glibc and libstdc++ linked statically
# (`-C target-feature=+crt-static`), libzmq compiled in by the `zmq` crate's vendored
# build. The operator supplies every argument (role, model path, ports, peers); the model
# comes from a volume.
FROM scratch
COPY tandem-dataplane /usr/local/bin/tandem-dataplane
USER 65532:65532
EXPOSE 8000 5600
ENTRYPOINT ["/usr/local/bin/tandem-dataplane"]
