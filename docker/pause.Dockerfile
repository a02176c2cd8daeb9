# The pod sandbox image of the end-to-end node (registry.k8s.io/pause is not reachable
# from CI, and every image there is built locally): a static C program that holds the
# pod's namespaces and reaps what it inherits (docker/pause.c). The context is a directory
# holding only the binary (scripts/images.sh compiles it with `cc -static`).
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
