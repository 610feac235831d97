// MathJax 3 for pymdownx.arithmatex (generic mode: \( \) and \[ \]) and for the tutorials'
// Markdown cells ($ $ and $$ $$). Code (pre, code) is never typeset; an element of class
// tex2jax_ignore is left alone.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true
  },
  options: {
    ignoreHtmlClass: "tex2jax_ignore|md-search|md-nav|md-header",
    processHtmlClass: "tex2jax_process|arithmatex"
  }
};

// Material's instant navigation swaps pages without reloading: typeset each new page.
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax && MathJax.startup && MathJax.typesetPromise) {
      MathJax.startup.output.clearCache();
      MathJax.typesetClear();
      MathJax.texReset();
      MathJax.typesetPromise();
    }
  });
}
