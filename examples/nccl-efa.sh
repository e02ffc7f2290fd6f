# NCCL over EFA (docs/cluster.md, "EFA on p5"). cluster.yaml's setup sources this from ~/.bashrc on every
# node, so `ray start`, its raylet and every actor the raylet starts inherit what it exports; on a node
# without an EFA device (g6, the head) it exports nothing and NCCL keeps to TCP sockets.
if /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1; then
    # libfabric's EFA provider, with GPUDirect RDMA between the H100s and the EFA devices.
    export FI_PROVIDER=efa
    export FI_EFA_USE_DEVICE_RDMA=1
    # AWS's NCCL net plugin (aws-ofi-nccl), where the DLAMI's EFA installer put it (the directory moved
    # between releases); NCCL loads libnccl-net*.so from the library path. With NCCL_DEBUG=INFO a
    # worker's log says "NET/OFI Selected Provider is efa" once it took.
    for dir in /opt/amazon/ofi-nccl/lib /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu /opt/aws-ofi-nccl/lib; do
        if ls "$dir"/libnccl-net*.so >/dev/null 2>&1; then
            export LD_LIBRARY_PATH="$dir:/opt/amazon/efa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            break
        fi
    done
fi
