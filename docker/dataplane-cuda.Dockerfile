# The Tandem dataplane with the CUDA backend (`--device cuda`), on an NVIDIA CUDA runtime
# base. Not built by `make test` (the base images are pulled from a registry); build it
# from the repository root where a Docker daemon can pull:
#
#   docker build -f docker/dataplane-cuda.Dockerfile -t ghcr.io/tandem/dataplane:0.1.0-cuda .
#
# The binary is linked dynamically: the CUDA backend dlopens the driver (libcuda.so.1,
# mounted into the container by the NVIDIA container toolkit) and NVRTC (libnvrtc.so.12,
# part of the runtime base), which a statically linked glibc cannot do. Nothing CUDA is
# needed to compile: the kernels are compiled by NVRTC when the process starts, for the
# GPU it finds.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tandem-dataplane --bin tandem-dataplane --features cuda \
 && install -D target/release/tandem-dataplane /out/tandem-dataplane

FROM docker.io/nvidia/cuda:12.9.1-runtime-ubuntu24.04
COPY --from=build /out/tandem-dataplane /usr/local/bin/tandem-dataplane
USER 65532:65532
EXPOSE 8000 5600
ENTRYPOINT ["/usr/local/bin/tandem-dataplane"]
