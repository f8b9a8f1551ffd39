# Sourced by the scripts: makes a Vulkan adapter available. On a machine
# without a GPU driver it installs Mesa's lavapipe (software Vulkan) and pins it.
has_vulkan_icd() { ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1; }
if ! has_vulkan_icd || ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "no Vulkan driver found and no apt-get to install Mesa lavapipe" >&2
  fi
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
# Without a hardware driver, pin lavapipe (the loader also offers GL/llvmpipe).
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] \
   && ! ls /dev/dri/renderD* /dev/nvidia0 >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json
fi
export MARKBASE_BACKEND="${MARKBASE_BACKEND:-vulkan}"
