// Compile a .ksy (given as JSON on stdin, already parsed from YAML) to files of LANGUAGE
// (default python) in OUT_DIR.
// Usage: node compile.js OUT_DIR [LANGUAGE] < kv.json   (the compiler package is found via NODE_PATH)
const fs = require("fs");
const path = require("path");
const compiler = require("kaitai-struct-compiler");
const ksy = JSON.parse(fs.readFileSync(0, "utf-8"));
compiler
  .compile(process.argv[3] || "python", ksy, null, false)
  .then((files) => {
    for (const [name, text] of Object.entries(files)) {
      fs.writeFileSync(path.join(process.argv[2], name), text);
      console.log(name);
    }
  })
  .catch((error) => {
    console.error(String(error && error.stack ? error.stack : JSON.stringify(error)));
    process.exit(1);
  });
